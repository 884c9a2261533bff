"""Ape-X's configuration (Horgan et al. 2018): double DQN with a dueling head and n-step
returns, a Redis prioritized replay, per-actor epsilons. The defaults solve CartPole-v1 on a
2-core machine (docs/benchmarks.md, "Solve time on CartPole-v1")."""

from __future__ import annotations

from pydantic import Field

from qrl.algos.apex_family.config import ReplayConfig
from qrl.runtime.config import Layers


class ApexConfig(ReplayConfig):
    """Ape-X: actors -> experience stream -> replay fillers -> prioritized replay -> learner."""

    hidden: Layers = Field((256, 256), description="Hidden layer sizes of the Q-network.")
    dueling: bool = Field(True, description="Dueling head (value + advantage).")
    obs_scale: bool = Field(
        True,
        description="Scale vector observations to [-1, 1] by their space's finite bounds.",
    )
    lr: float = Field(5e-3, gt=0, le=1, description="Adam learning rate.")
    adam_eps: float = Field(1e-5, gt=0, description="Adam epsilon.")
    grad_clip: float = Field(10.0, gt=0, description="Gradient norm clip.")
    target_update: int = Field(250, ge=1, description="Updates between target-network syncs.")
    eps_base: float = Field(0.4, gt=0, lt=1, description="Ape-X epsilon base.")
    eps_alpha: float = Field(7.0, ge=0, description="Ape-X epsilon exponent spread.")
