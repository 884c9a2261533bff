"""The update rule of Ape-X's and Gorila's learners: the Q-network and its target, and the
loss: double DQN with a dueling head and n-step targets, an IS-weighted Huber loss,
|TD error| as new priorities."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qrl.algos.apex_family.config import QLearning
from qrl.learners.base import adam
from qrl.learners.replay import Batch
from qrl.learners.rule import Rule, Update
from qrl.replay.frames import layout_for
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import q_network


class DQNRule(Rule):
    """The target network is copied every ``target_update`` updates if ``own_target``
    (Gorila's learner copies it as the pulled parameters' versions say instead:
    :class:`qrl.learners.gorila.PSStep`)."""

    def __init__(
        self, cfg: QLearning, env: EnvSpec, device: torch.device, own_target: bool = True
    ) -> None:
        self.cfg, self.own_target = cfg, own_target
        self.target = q_network(cfg, env).to(device)  # (made first: the seed's first draws)
        self.layout = layout_for(env.obs_shape, env.obs_dtype, env.discrete_actions())
        self.net = q_network(cfg, env).to(device)

    def optimizer(self) -> torch.optim.Optimizer:
        return adam(self.net.parameters(), lr=self.cfg.lr, eps=self.cfg.adam_eps)

    def begin(self) -> None:
        self.sync_target()

    def sync_target(self) -> None:
        self.target.load_state_dict(self.net.state_dict())

    def loss(self, b: Batch, updates: int) -> Update:
        """IS-weighted Huber loss of the n-step double-DQN target."""
        q = self.net(b.obs).gather(1, b.action[:, None])[:, 0]
        with torch.no_grad():
            best = self.net(b.next_obs).argmax(dim=1, keepdim=True)
            target = b.ret + b.disc * self.target(b.next_obs).gather(1, best)[:, 0]
        loss = (b.weight * F.smooth_l1_loss(q, target, reduction="none")).mean()
        return Update(loss, (target - q).detach().abs())

    def after_step(self, updates: int, steps: int) -> None:
        if self.own_target and updates % self.cfg.target_update == 0:
            self.sync_target()
