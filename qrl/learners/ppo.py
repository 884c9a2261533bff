"""The PPO learner (Schulman et al. 2017), alone or one of a pool of ``learners`` synchronous
processes (OpenAI Five, DD-PPO: the pool is :class:`qrl.learners.base.Learner`'s).

Each update, every learner takes its share of the rollouts (``batch_unrolls / learners``)
from the rollout stream's consumer group, drops those acted with weights more than
``max_policy_lag`` updates old or claiming weights not yet published (counted as
``stale``), computes GAE with advantages normalized over the whole pool's batch, and runs
``epochs`` passes of ``minibatches`` minibatches of PPO's clipped objective (optionally
clipped value loss, entropy bonus), each gradient averaged over the pool before the step.
Then the leader publishes the weights and the entries are acknowledged.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from qrl.algos.ppo.gae import gae
from qrl.algos.ppo.keys import rollouts
from qrl.algos.ppo.messages import rollout_schema
from qrl.learners.base import adam
from qrl.learners.unrolls import UnrollBatch, UnrollLearner
from qrl.rl.models import policy_value_net

log = logging.getLogger(__name__)


class PPOLearner(UnrollLearner):
    algo = "ppo"
    stream = rollouts
    schema = rollout_schema

    def build(self) -> torch.nn.Module:
        cfg = self.cfg
        self.obs_shape = self.env.obs_shape
        net = policy_value_net(cfg, self.env).to(self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.stale = 0  # rollouts dropped for exceeding max_policy_lag
        self.grad_steps = 0
        self.lag: list[float] = []
        self.stats: dict[str, list[float]] = {"kl": [], "clip_frac": [], "entropy": []}
        return net

    def optimizer(self) -> torch.optim.Optimizer:
        return adam(self.net.parameters(), lr=self.cfg.lr, eps=1e-5)

    def loader_slots(self) -> int:
        return 1 if self.cfg.pace_actors else super().loader_slots()  # one batch per version:
        # no reading ahead

    def next_batch(self, timeout: float) -> UnrollBatch | None:
        b = self.take(timeout)
        if b is None:
            return None
        lag = self.updates - b.versions
        fresh = (lag >= 0) & (lag <= self.cfg.max_policy_lag)  # none acted by future weights
        self.lag.extend(lag[lag >= 0].tolist())
        if not fresh.all():
            keep = torch.from_numpy(fresh).to(self.device)
            self.stale += int((~keep).sum())
            if not keep.any():
                self.used(b)
                return None
            b = b.select(keep)
        return b

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

    def train(self, b: UnrollBatch) -> float:
        """One PPO update on this learner's share; returns the mean loss (NaN if every
        minibatch step was skipped)."""
        assert b.value is not None
        adv, ret = self._targets(b)
        n = adv.numel()  # advantages normalized over the whole pool's batch
        s = self.group.sum(
            torch.tensor([n, float(adv.sum()), float((adv**2).sum())], dtype=torch.float64)
        )
        mean = s[1] / s[0]
        std = (s[2] / s[0] - mean**2).clamp(min=0).sqrt()
        adv = ((adv - mean.float()) / (std.float() + 1e-8)).reshape(-1)
        action = b.action.reshape(-1)
        old_logp = F.log_softmax(b.logits, -1).reshape(n, -1).gather(1, action[:, None])[:, 0]
        obs = b.obs[:-1].reshape(n, *self.obs_shape)
        data = (obs, action, old_logp, adv, b.value.reshape(-1), ret.reshape(-1))
        losses = []
        for _ in range(self.cfg.epochs):
            perm = torch.randperm(n, generator=self.gen, device=self.device)
            # the same number of minibatches on every learner: one all-reduce each
            for mb in torch.tensor_split(perm, self.cfg.minibatches):
                loss = self.minibatch_loss(*(x[mb] for x in data))
                if self.step_on(loss):
                    self.grad_steps += 1
                    losses.append(loss.item())
                else:
                    self.skipped += 1
                    log.warning("non-finite gradient at update %d: step skipped", self.updates)
        self.updates += 1
        self.publish()
        self.used(b)
        return float(np.mean(losses)) if losses else float("nan")

    def minibatch_loss(
        self,
        obs: torch.Tensor,
        action: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        old_v: torch.Tensor,
        ret: torch.Tensor,
    ) -> torch.Tensor:
        """PPO's loss on one minibatch: clipped surrogate, (clipped) value loss, entropy."""
        cfg = self.cfg
        logits, v = self.net(obs)
        logp_all = F.log_softmax(logits, -1)
        logp = logp_all.gather(1, action[:, None])[:, 0]
        log_ratio = logp - old_logp
        ratio = log_ratio.exp()
        pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)).mean()
        v_loss = (v - ret) ** 2
        if cfg.value_clip > 0:
            v_clipped = old_v + (v - old_v).clamp(-cfg.value_clip, cfg.value_clip)
            v_loss = torch.max(v_loss, (v_clipped - ret) ** 2)
        entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        with torch.no_grad():
            self.stats["kl"].append(float(((ratio - 1) - log_ratio).mean()))
            self.stats["clip_frac"].append(float(((ratio - 1).abs() > cfg.clip).float().mean()))
            self.stats["entropy"].append(float(entropy))
        return pg_loss + cfg.value_cost * 0.5 * v_loss.mean() - cfg.entropy_cost * entropy

    def extra_metrics(self) -> dict[str, float]:
        lag, self.lag = self.lag, []
        stats = {k: float(np.mean(v)) if v else 0.0 for k, v in self.stats.items()}
        self.stats = {k: [] for k in self.stats}
        return {
            "policy_lag": float(np.mean(lag)) if lag else 0.0,
            "stale": float(self.stale),
            "grad_steps": float(self.grad_steps),
            **stats,
        }
