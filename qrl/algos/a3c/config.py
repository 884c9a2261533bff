"""A3C's configuration: ``workers`` actor-learner processes, each with vectorized envs,
compute n-step advantage actor-critic gradients on the parameters they last pulled and push
them to the parameter server (:mod:`qrl.ps`), which applies them with a shared RMSProp as
they come. The defaults solve CartPole-v1 and Acrobot-v1 on a 2-core machine
(docs/benchmarks.md, "The defaults: A3C and Gorila").

Whose each default is: the A3C paper's (Mnih et al. 2016) where it says "the paper's";
otherwise SB3's A2C (its defaults, and rl-baselines3-zoo's CartPole-v1 settings), or qrl's
own measurement, as each field's text says."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qrl.ps.config import ParameterServerConfig
from qrl.runtime.config import (
    LIVE,
    ClaimIdle,
    Config,
    GradientClip,
    Layers,
    LearningRate,
    Torso,
    grad_clip_field,
    lr_field,
)


class A3CConfig(ParameterServerConfig, LearningRate, GradientClip, Torso, ClaimIdle, Config):
    """A3C: actor-learners -> gradient streams -> parameter-server shards -> parameters."""

    hidden: Layers = Field((64, 64), description="Hidden layer sizes of the policy-value net.")
    activation: Literal["relu", "tanh"] = Field(
        "tanh",
        description="The hidden layers' activation: tanh, as SB3's A2C policies have; with "
        "ReLU, one worker needed twice the env steps to solve CartPole-v1 (14k-164k) and the "
        "job 10-79 s (docs/benchmarks.md, 'The defaults: A3C and Gorila').",
    )
    workers: int = Field(
        2, ge=1, le=4096, description="Actor-learner processes (the paper: 16; one per core here)."
    )
    envs_per_worker: int = Field(
        16,
        ge=1,
        le=4096,
        description="Environments per worker, stepped together (the paper: one per thread; "
        "SB3's A2C: 8). 16 at lr 2e-3 solved CartPole-v1 in a median 6.7 s where 8 at 7e-4 "
        "took 8.2 s, Acrobot-v1 as fast (docs/benchmarks.md, 'The defaults: A3C and Gorila').",
    )
    unroll: int = Field(
        5, ge=1, le=10_000, description="Steps per gradient (n of n-step returns; the paper's 5)."
    )
    pull_every: int = Field(
        1,
        ge=1,
        le=10_000,
        description="Gradients a worker pushes between parameter pulls (the paper pulls "
        "before each unroll).",
    )
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor (the paper's).")
    optimizer: Literal["rmsprop", "adam"] = Field(
        "rmsprop", description="The servers' optimizer (A3C's shared RMSProp, or Adam)."
    )
    lr: float = lr_field(
        2e-3,
        description="The servers' learning rate (the paper sampled 1e-4 to 1e-2 per run; SB3's "
        "A2C: 7e-4 for 8 envs). Chosen with envs_per_worker.",
    )
    rms_alpha: float = Field(
        0.99, gt=0, lt=1, description="RMSProp's smoothing constant (the paper's)."
    )
    rms_eps: float = Field(1e-5, gt=0, description="RMSProp's (or Adam's) epsilon (SB3's A2C).")
    grad_clip: float = grad_clip_field(0.5, "A worker's gradient norm clip (SB3's A2C).")
    entropy_cost: float = Field(
        0.0,
        ge=0,
        description="Entropy bonus weight (rl-baselines3-zoo's CartPole-v1 A2C; the paper: "
        "0.01, which slowed CartPole-v1: docs/benchmarks.md, 'The defaults: A3C and Gorila').",
        json_schema_extra=LIVE,
    )
    value_cost: float = Field(
        0.5, ge=0, description="Value loss weight (SB3's A2C).", json_schema_extra=LIVE
    )
    reward_scale: float = Field(
        0.1,
        gt=0,
        description="Rewards are multiplied by this for learning (not for reports): at 1 the "
        "value loss outweighs the policy's in the clipped gradient and Acrobot-v1 did not "
        "solve in 200 s (docs/benchmarks.md, 'The defaults: A3C and Gorila').",
    )
