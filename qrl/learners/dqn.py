"""What Ape-X's and Gorila's learners share (:class:`qrl.learners.replay.ReplayLearner`):
the Q-network and its target, and the loss: double DQN with a dueling head and n-step
targets, an IS-weighted Huber loss, |TD error| as new priorities."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qrl.learners.replay import Batch, ReplayLearner
from qrl.replay.frames import layout_for
from qrl.rl.models import q_network


class DQNLearner(ReplayLearner):
    def build(self) -> torch.nn.Module:
        cfg, env = self.cfg, self.env
        self.target = q_network(cfg, env).to(self.device)
        self.layout = layout_for(env.obs_shape, env.obs_dtype, env.discrete_actions())
        return q_network(cfg, env).to(self.device)

    def loss(self, b: Batch) -> torch.Tensor:
        """IS-weighted Huber loss of the n-step double-DQN target."""
        q = self.net(b.obs).gather(1, b.action[:, None])[:, 0]
        with torch.no_grad():
            best = self.net(b.next_obs).argmax(dim=1, keepdim=True)
            target = b.ret + b.disc * self.target(b.next_obs).gather(1, best)[:, 0]
        b.priority = (target - q).detach().abs()
        return (b.weight * F.smooth_l1_loss(q, target, reduction="none")).mean()
