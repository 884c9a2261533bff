"""PPO's configuration (Schulman et al. 2017): actors send rollouts acted with the latest
weights, a pool of ``learners`` synchronous learners runs PPO's clipped objective on each
batch and all-reduces the gradients. The defaults solve CartPole-v1, Acrobot-v1 and
LunarLander-v3 on a 2-core machine (docs/benchmarks.md, "The defaults: PPO")."""

from __future__ import annotations

from pydantic import Field

from qrl.runtime.config import (
    LIVE,
    Annealed,
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


class PPOConfig(Annealed, LearningRate, GradientClip, Torso, ClaimIdle, Unrolls, Config):
    """PPO: actors -> rollout stream -> a pool of synchronous learners."""

    # the PPO paper's Atari settings (its vector tasks' are the fields' defaults): at this
    # lr, epochs and clip MinAtar's learner keeps up with the actors and does not collapse
    # late (docs/benchmarks.md, "MinAtar: the image defaults"). The paper also anneals lr
    # and clip to 0 (``anneal``): off here, slower on classic control and far lower on a
    # MinAtar pair (docs/benchmarks.md, "The defaults: PPO")
    image_defaults = {"lr": 2.5e-4, "epochs": 4, "clip": 0.1}

    hidden: Layers = Field((64, 64), description="Hidden layer sizes of the policy-value net.")
    # learning
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE's lambda.")
    lr: float = lr_field(1e-3, description="Adam learning rate.")
    grad_clip: float = grad_clip_field(0.5)
    clip: float = Field(
        0.2, gt=0, le=1, description="PPO's ratio clip (epsilon).", json_schema_extra=LIVE
    )
    value_clip: float = Field(
        0.0,
        ge=0,
        description="Clip the value function's change per update to this, in scaled reward "
        "units, as PPO's reference code does (0: off; notes/benchmarks-notebook.md, "
        "'The defaults on three tasks').",
        json_schema_extra=LIVE,
    )
    entropy_cost: float = Field(
        0.01,
        ge=0,
        description="Entropy bonus weight (at 0 LunarLander-v3 seed 1 collapsed and never "
        "solved: notes/benchmarks-notebook.md, 'The defaults on three tasks').",
        json_schema_extra=LIVE,
    )
    value_cost: float = Field(0.5, ge=0, description="Value loss weight.", json_schema_extra=LIVE)
    reward_scale: float = Field(
        1.0, gt=0, description="Rewards are multiplied by this for learning (not for reports)."
    )
    epochs: int = Field(10, ge=1, le=1000, description="Passes over each batch.")
    minibatches: int = Field(
        4, ge=1, le=4096, description="Minibatches per pass (per learner: each takes its share)."
    )
    max_policy_lag: int = Field(
        2,
        ge=0,
        description="Drop rollouts acted with weights more than this many updates old; "
        "counted as stale (the clipped ratio is taken against the acting policy, so a "
        "small lag is corrected; a long one leaves the trust region).",
    )
    pace_actors: bool = Field(
        True,
        description="Actors make one batch per published version (together), so none is "
        "made only to be dropped as stale (notes/benchmarks-notebook.md, 'The defaults on "
        "three tasks').",
    )
    batches_ahead: int = Field(
        1,
        ge=0,
        le=16,
        description="With pace_actors, batches the actors may make beyond the current "
        "version's: 1 overlaps acting with training (rollouts one update old), 0 takes turns.",
    )
    # actors (Unrolls' fields, PPO's defaults)
    envs_per_actor: int = Field(
        8, ge=1, le=4096, description="Environments per actor (rollouts per stream entry)."
    )
    unroll: int = Field(32, ge=1, le=10_000, description="Steps per rollout.")
