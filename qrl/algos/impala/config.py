"""IMPALA's configuration (Espeholt et al. 2018): actors send unrolls, the learner corrects
for policy lag with V-trace. The defaults solve CartPole-v1 and Acrobot-v1 on a 2-core machine
(docs/benchmarks.md, "The defaults: IMPALA")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qrl.runtime.config import (
    LIVE,
    CentralInference,
    ClaimIdle,
    Config,
    GradientClip,
    Layers,
    LearningRate,
    Torso,
    Unrolls,
    grad_clip_field,
    lr_field,
)


class ImpalaConfig(LearningRate, GradientClip, Torso, ClaimIdle, CentralInference, Unrolls, Config):
    """IMPALA: actors -> trajectory stream -> V-trace learner."""

    # MinAtar's rewards are 0 or 1 a step (the paper clipped Atari's to [-1, 1]): scaled by
    # the vector tasks' 0.01 the entropy bonus outweighed them and the policy stayed near
    # uniform (docs/benchmarks.md, "MinAtar: the image defaults")
    image_defaults = {"reward_scale": 1.0}

    hidden: Layers = Field((64, 64), description="Hidden layer sizes of the policy-value net.")
    # learning
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    lr: float = lr_field(2e-3, description="Learning rate.")
    optimizer: Literal["adam", "rmsprop"] = Field("adam", description="Optimizer.")
    grad_clip: float = grad_clip_field(40.0)
    rho_bar: float = Field(1.0, gt=0, description="V-trace importance-weight clip (rho).")
    c_bar: float = Field(1.0, gt=0, description="V-trace trace clip (c).")
    entropy_cost: float = Field(
        0.01, ge=0, description="Entropy bonus weight.", json_schema_extra=LIVE
    )
    baseline_cost: float = Field(
        0.5, ge=0, description="Value loss weight.", json_schema_extra=LIVE
    )
    reward_scale: float = Field(
        0.01,
        gt=0,
        description="Rewards are multiplied by this for learning (not for reports). 0.01 "
        "keeps values and advantages near 1 on classic control and Box2D tasks; at 1 the "
        "policy collapsed on Acrobot-v1 (docs/benchmarks.md, 'The defaults: IMPALA').",
    )
    passes: int = Field(
        3,
        ge=1,
        le=64,
        description="Gradient steps a batch may give: after the first, another pass over "
        "it only while no fresh batch is waiting (sample reuse, V-trace corrects the lag; "
        "it pays when the actors are the bound, e.g. a slow simulator; 1: off). 3 took "
        "fewer env steps than 1 on each task of the defaults table (docs/benchmarks.md, "
        "'The defaults: IMPALA').",
    )
    publish_every: int = Field(1, ge=1, description="Updates between weight publications.")
    max_policy_lag: int = Field(
        0, ge=0, description="Drop unrolls older than this many updates (0: keep all)."
    )
