"""The Ape-X learner (:class:`qrl.learners.replay.ReplayLearner`): double DQN with a dueling
head and n-step targets, an IS-weighted Huber loss, |TD error| as new priorities."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qrl.learners.base import adam
from qrl.learners.replay import Batch, ReplayLearner
from qrl.replay.frames import layout_for
from qrl.rl.models import q_network


class ApexLearner(ReplayLearner):
    algo = "apex"

    def build(self) -> torch.nn.Module:
        cfg, env = self.cfg, self.env
        self.target = q_network(cfg, env).to(self.device)
        self.layout = layout_for(env.obs_shape, env.obs_dtype, env.discrete_actions())
        return q_network(cfg, env).to(self.device)

    def optimizer(self) -> torch.optim.Optimizer:
        return adam(self.net.parameters(), lr=self.cfg.lr, eps=self.cfg.adam_eps)

    def loss(self, b: Batch) -> torch.Tensor:
        """IS-weighted Huber loss of the n-step double-DQN target."""
        q = self.net(b.obs).gather(1, b.action[:, None])[:, 0]
        with torch.no_grad():
            best = self.net(b.next_obs).argmax(dim=1, keepdim=True)
            target = b.ret + b.disc * self.target(b.next_obs).gather(1, best)[:, 0]
        b.priority = (target - q).detach().abs()
        return (b.weight * F.smooth_l1_loss(q, target, reduction="none")).mean()
