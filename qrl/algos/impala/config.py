"""IMPALA's configuration (Espeholt et al. 2018): actors send unrolls, the learner corrects
for policy lag with V-trace. The defaults solve CartPole-v1 and Acrobot-v1 on a 2-core machine
(docs/benchmarks.md, "Do the defaults generalize?")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qrl.runtime.config import (
    LIVE,
    ClaimIdle,
    Config,
    GradientClip,
    Layers,
    LearnerPool,
    LearningRate,
    grad_clip_field,
    lr_field,
)


class ImpalaConfig(LearningRate, GradientClip, ClaimIdle, LearnerPool, Config):
    """IMPALA: actors -> trajectory stream -> V-trace learner."""

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
        "policy collapsed on Acrobot-v1 (docs/benchmarks.md, 'Do the defaults generalize?').",
    )
    batch_unrolls: int = Field(
        32,
        ge=1,
        le=65_536,
        description="Unrolls per update, over all learners (each takes batch_unrolls/learners).",
    )
    passes: int = Field(
        3,
        ge=1,
        le=64,
        description="Gradient steps a batch may give: after the first, another pass over "
        "it only while no fresh batch is waiting (sample reuse, V-trace corrects the lag; "
        "it pays when the actors are the bound, e.g. a slow simulator; 1: off). 3 took "
        "fewer env steps than 1 on each task of the defaults table (docs/benchmarks.md, "
        "'Do the defaults generalize?').",
    )
    publish_every: int = Field(1, ge=1, description="Updates between weight publications.")
    max_policy_lag: int = Field(
        0, ge=0, description="Drop unrolls older than this many updates (0: keep all)."
    )
    # actors
    actors: int = Field(2, ge=1, le=4096, description="Actor processes.")
    envs_per_actor: int = Field(
        16, ge=1, le=4096, description="Environments per actor (unrolls per stream entry)."
    )
    unroll: int = Field(20, ge=1, le=10_000, description="Steps per unroll.")
    weight_poll: int = Field(1, ge=1, description="Unrolls between weight-version checks.")
    stream_maxlen: int = Field(
        8, ge=1, description="Trajectory-stream entries waiting before actors back off."
    )

    @model_validator(mode="after")
    def _shares(self) -> ImpalaConfig:
        if self.batch_unrolls % self.learners:
            raise ValueError(
                f"batch_unrolls={self.batch_unrolls} must be a multiple of "
                f"learners={self.learners} (each learner takes an equal share)"
            )
        return self
