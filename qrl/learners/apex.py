"""The Ape-X learner (:class:`qrl.learners.dqn.DQNLearner`), stepping its own Adam."""

from __future__ import annotations

import torch

from qrl.learners.base import adam
from qrl.learners.dqn import DQNLearner


class ApexLearner(DQNLearner):
    algo = "apex"

    def optimizer(self) -> torch.optim.Optimizer:
        return adam(self.net.parameters(), lr=self.cfg.lr, eps=self.cfg.adam_eps)
