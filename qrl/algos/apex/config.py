"""Ape-X's configuration (Horgan et al. 2018): double DQN with a dueling head and n-step
returns, a Redis prioritized replay, per-actor epsilons. The defaults solve CartPole-v1 on a
2-core machine (docs/benchmarks.md, "The defaults: Ape-X")."""

from __future__ import annotations

from pydantic import Field

from qrl.algos.apex_family.config import QLearning, ReplayConfig
from qrl.runtime.config import Layers, LearningRate, lr_field


class ApexConfig(LearningRate, QLearning, ReplayConfig):
    """Ape-X: actors -> experience stream -> replay fillers -> prioritized replay -> learner."""

    # MinAtar's frames (docs/benchmarks.md, "MinAtar: the image defaults"): there the
    # learner bounds Ape-X, as in the paper, whose actors far outran it. A batch of 128 costs
    # a CPU learner about 1.15x one of 64, and 32 env steps an update (4 transitions
    # replayed per env step: SB3's DQN replays 8, the paper's learner fewer) let the actors
    # take 3-4x the env steps of the vector tasks' 4 in 5 minutes. CartPole's lr 5e-3 is too
    # high for the conv net: on Breakout and SpaceInvaders 5e-4 beat 1e-3, which beat 2e-3
    image_defaults = {"batch_size": 128, "steps_per_update": 32.0, "lr": 5e-4}

    hidden: Layers = Field((256, 256), description="Hidden layer sizes of the Q-network.")
    lr: float = lr_field(5e-3)
