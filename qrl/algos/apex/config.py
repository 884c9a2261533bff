"""Ape-X's configuration (Horgan et al. 2018): double DQN with a dueling head and n-step
returns, a Redis prioritized replay, per-actor epsilons. The defaults solve CartPole-v1 on a
2-core machine (docs/benchmarks.md, "The defaults: Ape-X")."""

from __future__ import annotations

from pydantic import Field

from qrl.algos.apex_family.config import QLearning, ReplayConfig
from qrl.runtime.config import Layers, LearningRate, lr_field


class ApexConfig(LearningRate, QLearning, ReplayConfig):
    """Ape-X: actors -> experience stream -> replay fillers -> prioritized replay -> learner."""

    hidden: Layers = Field((256, 256), description="Hidden layer sizes of the Q-network.")
    lr: float = lr_field(5e-3)
