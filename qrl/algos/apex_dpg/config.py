"""Ape-X DPG's configuration (Horgan et al. 2018, with TD3's learner: Fujimoto et al.
2018): the Ape-X replay, fillers and actors (:class:`ReplayConfig`) around a deterministic
actor with per-actor Gaussian noise and twin critics with Polyak-averaged targets."""

from __future__ import annotations

from pydantic import Field

from qrl.algos.apex_family.config import ReplayConfig
from qrl.rl.fields import VALUE_BOUND
from qrl.runtime.config import LIVE, GradientClip, Layers, grad_clip_field, lr_field


class ApexDPGConfig(GradientClip, ReplayConfig):
    """Ape-X DPG: Box actions through the Ape-X replay; TD3-style learner."""

    env: str = Field("Pendulum-v1", min_length=1, description="Gymnasium environment id.")
    # networks
    hidden: Layers = Field((256, 256), description="Hidden layer sizes of actor and critics.")
    # learning
    actor_lr: float = lr_field(1e-3, description="Adam learning rate of the actor.")
    critic_lr: float = lr_field(1e-3, description="Adam learning rate of the critics.")
    grad_clip: float = grad_clip_field(
        100.0, description="Gradient norm clip (actor and critics together)."
    )
    tau: float = Field(
        0.005,
        gt=0,
        le=1,
        description="Polyak rate of the target networks.",
        json_schema_extra=LIVE,
    )
    policy_delay: int = Field(
        2, ge=1, le=1000, description="Critic updates per actor update (TD3's delay)."
    )
    target_noise: float = Field(
        0.2,
        ge=0,
        le=10,
        description="Target policy smoothing noise (in [-1, 1] units).",
        json_schema_extra=LIVE,
    )
    noise_clip: float = Field(
        0.5,
        ge=0,
        le=10,
        description="Clip of the target policy smoothing noise.",
        json_schema_extra=LIVE,
    )
    # exploration
    # live: an actor computes its sigmas again (qrl.actors.apex_dpg.NoisyDPG.reconfigure)
    noise_base: float = Field(
        0.4,
        gt=0,
        lt=1,
        description="Gaussian exploration: env slot i's sigma is "
        "noise_base^(1 + i * noise_alpha / (N - 1)) (in [-1, 1] units, like Ape-X epsilons).",
        json_schema_extra=LIVE,
    )
    noise_alpha: float = Field(
        3.0, ge=0, description="Exploration noise exponent spread.", json_schema_extra=LIVE
    )
    initial_priority: float = Field(
        1000.0,
        gt=0,
        le=VALUE_BOUND,
        description="Priority actors give new transitions (above TD errors: each is "
        "sampled soon, then the learner sets its |TD error|).",
    )
    # overrides of the shared defaults
    batch_size: int = Field(256, ge=1, le=65_536, description="Transitions per learner update.")
    learning_starts: int = Field(
        2000, ge=0, description="Transitions in the replay before the first update."
    )
    steps_per_update: float = Field(
        1.0,
        ge=0,
        description="Rate limit: actors together take at most learning_starts + this x "
        "(learner updates) env steps (0: no limit).",
    )
