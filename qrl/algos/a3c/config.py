"""A3C's configuration: ``workers`` actor-learner processes, each with vectorized envs,
compute n-step advantage actor-critic gradients on the parameters they last pulled and push
them to the parameter server (:mod:`qrl.ps`), which applies them with a shared RMSProp as
they come. The defaults solve CartPole-v1 and Acrobot-v1 on a 2-core machine
(docs/benchmarks.md, "The defaults: A3C and Gorila")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qrl.ps.config import ParameterServerConfig
from qrl.runtime.config import (
    LIVE,
    ClaimIdle,
    Config,
    ConvTorso,
    GradientClip,
    Layers,
    LearningRate,
    grad_clip_field,
    lr_field,
)


class A3CConfig(ParameterServerConfig, LearningRate, GradientClip, ConvTorso, ClaimIdle, Config):
    """A3C: actor-learners -> gradient streams -> parameter-server shards -> parameters."""

    hidden: Layers = Field((64, 64), description="Hidden layer sizes of the policy-value net.")
    workers: int = Field(2, ge=1, le=4096, description="Actor-learner processes.")
    envs_per_worker: int = Field(
        8, ge=1, le=4096, description="Environments per worker, stepped together."
    )
    unroll: int = Field(5, ge=1, le=10_000, description="Steps per gradient (n of n-step returns).")
    pull_every: int = Field(
        1, ge=1, le=10_000, description="Gradients a worker pushes between parameter pulls."
    )
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    optimizer: Literal["rmsprop", "adam"] = Field(
        "rmsprop", description="The servers' optimizer (A3C's shared RMSProp, or Adam)."
    )
    lr: float = lr_field(7e-4, description="The servers' learning rate.")
    rms_alpha: float = Field(0.99, gt=0, lt=1, description="RMSProp's smoothing constant.")
    rms_eps: float = Field(1e-5, gt=0, description="RMSProp's (or Adam's) epsilon.")
    grad_clip: float = grad_clip_field(0.5, "A worker's gradient norm clip.")
    entropy_cost: float = Field(
        0.0, ge=0, description="Entropy bonus weight.", json_schema_extra=LIVE
    )
    value_cost: float = Field(0.5, ge=0, description="Value loss weight.", json_schema_extra=LIVE)
    reward_scale: float = Field(
        0.1,
        gt=0,
        description="Rewards are multiplied by this for learning (not for reports): at 1 the "
        "value loss outweighs the policy's in the clipped gradient and Acrobot-v1 did not "
        "solve in 200 s (docs/benchmarks.md, 'The defaults: A3C and Gorila').",
    )
