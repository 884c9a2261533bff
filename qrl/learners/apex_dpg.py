"""The Ape-X DPG learner's update rule, TD3-style (Fujimoto et al. 2018) on the Ape-X replay:
the sampler processes, batches, IS weights and priority updates are the Ape-X family's
(:class:`qrl.learners.replay.ReplaySource`); the loss is DPG's.

* Twin critics, the target taking the smaller of the two target critics: one critic's
  overestimation is what the actor learns to exploit in DDPG.
* Target policy smoothing: the target action gets clipped Gaussian noise, so the target
  does not ride a sharp peak of the critic.
* Delayed policy updates: the actor steps every ``policy_delay`` critic steps, on a critic
  whose error has had time to shrink (a moving critic gives the actor a noisy gradient);
  the other critic steps skip the actor's loss, forward and backward.
* Polyak-averaged targets (``tau``) after every update.

The critic loss is the IS-weighted squared error of both critics; the priority of a
transition is Q1's |TD error|. The actor's loss ``-Q1(s, pi(s))`` goes through Q1 with its
parameters detached, so one optimizer step (one Adam with an actor and a critic parameter
group) moves the critics by their loss and the actor by its own. Only the actor network is
published: it is all actors and evaluation need.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from qrl.algos.apex_dpg.config import ApexDPGConfig
from qrl.algos.apex_dpg.dpg import ActorCritic, critic_target, polyak, unscale_action
from qrl.learners.base import adam
from qrl.learners.replay import Batch
from qrl.learners.rule import Rule, Update
from qrl.replay.role import experience_spec
from qrl.rl.envspec import EnvSpec


class DPGRule(Rule):
    def __init__(self, cfg: ApexDPGConfig, env: EnvSpec, device: torch.device) -> None:
        self.cfg, obs_shape = cfg, env.obs_shape
        low, high = env.box_actions()
        self.low = torch.tensor(low, device=device)
        self.high = torch.tensor(high, device=device)
        net = ActorCritic(obs_shape, len(low), cfg.hidden).to(device)
        self.target = ActorCritic(obs_shape, len(low), cfg.hidden).to(device)
        self.target.requires_grad_(False)
        self.actor_view = nn.ModuleDict({"actor": net.actor})  # what is published
        self.layout, _ = experience_spec(env)
        self.q_mean = float("nan")
        self.net = net

    def optimizer(self) -> torch.optim.Optimizer:
        net, cfg = self.net, self.cfg
        return adam(
            [
                {"params": net.actor.parameters(), "lr": cfg.actor_lr},
                {"params": net.critic.parameters(), "lr": cfg.critic_lr},
            ]
        )

    def learning_rates(self) -> list[float]:
        return [self.cfg.actor_lr, self.cfg.critic_lr]  # the groups of optimizer()

    def published(self) -> nn.Module:
        return self.actor_view

    def begin(self) -> None:
        self.target.load_state_dict(self.net.state_dict())

    def loss(self, b: Batch, updates: int) -> Update:
        cfg, net = self.cfg, self.net
        target = critic_target(
            self.target, b.ret, b.disc, b.next_obs, cfg.target_noise, cfg.noise_clip
        )
        q1, q2 = net.critic(b.obs, unscale_action(b.action, self.low, self.high))
        priorities = (target - q1).detach().abs()
        loss = (b.weight * ((q1 - target) ** 2 + (q2 - target) ** 2)).mean()
        if (updates + 1) % cfg.policy_delay == 0:
            loss = loss - net.critic.q1_frozen(b.obs, net.actor(b.obs)).mean()
        self.q_mean = float(q1.detach().mean())
        return Update(loss, priorities)

    def after_step(self, updates: int, steps: int) -> None:
        polyak(self.target, self.net, self.cfg.tau)

    def metrics(self) -> dict[str, float]:
        q = self.q_mean if np.isfinite(self.q_mean) else 0.0
        return {"q_mean": q}
