"""The PPO learner's parts (Schulman et al. 2017), alone or one of a pool of ``learners``
synchronous processes (OpenAI Five, DD-PPO: the pool is :class:`qrl.learners.base.Learner`'s).

Each update, every learner takes its share of the rollouts (``batch_unrolls / learners``)
from the rollout stream's consumer group (:class:`qrl.learners.unrolls.UnrollSource`),
drops those acted with weights more than ``max_policy_lag`` updates old or claiming weights
not yet published (:class:`Fresh`, counted as ``stale``), computes GAE with advantages
normalized over the whole pool's batch, and runs ``epochs`` passes of ``minibatches``
minibatches of PPO's clipped objective (optionally clipped value loss, entropy bonus): the
parts of one update (:meth:`PPORule.parts`), each gradient averaged over the pool before
its step. Then the leader publishes the weights and the entries are acknowledged. With
``anneal`` the learning rate and the ratio clip fall linearly to 0 over the run's budget
(the PPO paper's Atari schedule, :class:`qrl.runtime.config.Annealed`): its env steps
counted as updates times the pool's batch, so a resumed learner goes on where it was, or its
time since this learner started.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from qrl.algos.ppo.config import PPOConfig
from qrl.algos.ppo.gae import gae
from qrl.learners.base import adam
from qrl.learners.group import LearnerGroup
from qrl.learners.rule import Rule, Update
from qrl.learners.unrolls import UnrollBatch
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import policy_value_net
from qrl.wire import clock

log = logging.getLogger(__name__)

# a minibatch: observations, actions, old log-probabilities, advantages, old values, returns
Minibatch = tuple[torch.Tensor, ...]


class Fresh:
    """Keeps the rollouts acted at most ``limit`` updates before and none acted by weights
    not yet published (a learner restarted behind its actors); counts the lag of those
    acted before and the others as ``stale``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stale = 0  # rollouts dropped
        self.lag: list[float] = []

    def __call__(self, b: UnrollBatch, updates: int) -> UnrollBatch | None:
        lag = updates - b.versions
        fresh = (lag >= 0) & (lag <= self.limit)  # none acted by future weights
        self.lag.extend(lag[lag >= 0].tolist())
        if not fresh.all():
            keep = torch.from_numpy(fresh).to(b.obs.device)
            self.stale += int((~keep).sum())
            if not keep.any():
                return None
            b = b.select(keep)
        return b

    def metrics(self) -> dict[str, float]:
        lag, self.lag = self.lag, []
        return {"policy_lag": float(np.mean(lag)) if lag else 0.0, "stale": float(self.stale)}


class PPORule(Rule):
    counts_skipped = True  # the batch is spent and the update paces the actors

    def __init__(self, cfg: PPOConfig, env: EnvSpec, device: torch.device) -> None:
        self.cfg, self.device, self.obs_shape = cfg, device, env.obs_shape
        self.net = policy_value_net(cfg, env).to(device)
        self.gen = torch.Generator(device=device).manual_seed(cfg.seed)
        self.grad_steps = 0
        self.stats: dict[str, list[float]] = {"kl": [], "clip_frac": [], "entropy": []}
        self.batch_steps = 0  # env steps in the pool's last batch (the same every update)
        self.started = clock.now()
        self.remaining = 1.0  # the schedule's factor for this update (Annealed.remaining)

    def optimizer(self) -> torch.optim.Optimizer:
        return adam(self.net.parameters(), lr=self.cfg.lr, eps=1e-5)

    def learning_rates(self) -> list[float]:
        return [self.cfg.lr * self.remaining]

    def _targets(self, b: UnrollBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE advantages and returns ``[T, B]``; where a time limit cut an episode its reward
        gets ``gamma V(final observation)``."""
        cfg = self.cfg
        reward = b.rewards(self.net, cfg.reward_scale, cfg.gamma)
        with torch.no_grad():
            _, bootstrap = self.net(b.obs[-1])
        discounts = cfg.gamma * (~b.done).float()
        assert b.value is not None
        return gae(reward, discounts, b.value, bootstrap, cfg.gae_lambda)

    def parts(self, b: UnrollBatch, group: LearnerGroup) -> Iterator[Minibatch]:
        """``epochs`` shuffles of this learner's share into ``minibatches`` minibatches (the
        same number on every learner: one all-reduce each), advantages normalized over the
        pool's whole batch."""
        assert b.value is not None
        adv, ret = self._targets(b)
        n = adv.numel()
        s = group.sum(
            torch.tensor([n, float(adv.sum()), float((adv**2).sum())], dtype=torch.float64)
        )
        self.batch_steps = int(s[0])
        mean = s[1] / s[0]
        std = (s[2] / s[0] - mean**2).clamp(min=0).sqrt()
        adv = ((adv - mean.float()) / (std.float() + 1e-8)).reshape(-1)
        action = b.action.reshape(-1)
        old_logp = F.log_softmax(b.logits, -1).reshape(n, -1).gather(1, action[:, None])[:, 0]
        obs = b.obs[:-1].reshape(n, *self.obs_shape)
        data = (obs, action, old_logp, adv, b.value.reshape(-1), ret.reshape(-1))
        for _ in range(self.cfg.epochs):
            perm = torch.randperm(n, generator=self.gen, device=self.device)
            for mb in torch.tensor_split(perm, self.cfg.minibatches):
                yield tuple(x[mb] for x in data)

    def loss(self, part: Minibatch, updates: int) -> Update:
        """PPO's loss on one minibatch: clipped surrogate, (clipped) value loss, entropy."""
        obs, action, old_logp, adv, old_v, ret = part
        cfg = self.cfg
        logits, v = self.net(obs)
        logp_all = F.log_softmax(logits, -1)
        logp = logp_all.gather(1, action[:, None])[:, 0]
        log_ratio = logp - old_logp
        ratio = log_ratio.exp()
        clip = cfg.clip * self.remaining
        pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
        v_loss = (v - ret) ** 2
        if cfg.value_clip > 0:
            v_clipped = old_v + (v - old_v).clamp(-cfg.value_clip, cfg.value_clip)
            v_loss = torch.max(v_loss, (v_clipped - ret) ** 2)
        entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        with torch.no_grad():
            self.stats["kl"].append(float(((ratio - 1) - log_ratio).mean()))
            self.stats["clip_frac"].append(float(((ratio - 1).abs() > clip).float().mean()))
            self.stats["entropy"].append(float(entropy))
        return Update(pg_loss + cfg.value_cost * 0.5 * v_loss.mean() - cfg.entropy_cost * entropy)

    def after_step(self, updates: int, steps: int) -> None:
        self.grad_steps += steps
        # the next update's lr (the learner sets it after this) and clip
        self.remaining = self.cfg.remaining(updates * self.batch_steps, clock.now() - self.started)

    def metrics(self) -> dict[str, float]:
        stats = {k: float(np.mean(v)) if v else 0.0 for k, v in self.stats.items()}
        self.stats = {k: [] for k in self.stats}
        return {"grad_steps": float(self.grad_steps), "anneal": self.remaining, **stats}
