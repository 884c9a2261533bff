"""The IMPALA learner: batches of unrolls from the trajectory stream (consumer group),
V-trace targets, policy-gradient + baseline + entropy loss; entries are acknowledged only
after the update that used them.

A loader thread reads and decodes entries and stacks them into batches while the main
thread computes gradients.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.nn.functional as F

from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import unroll_schema
from qrl.algos.impala.vtrace import vtrace
from qrl.learners.base import Learner, adam
from qrl.learners.unrolls import UnrollBatch, UnrollLoader
from qrl.rl.models import policy_value_net
from qrl.wire.streams import StreamConsumer

log = logging.getLogger(__name__)


class ImpalaLearner(Learner):
    algo = "impala"

    def build(self) -> torch.nn.Module:
        cfg = self.cfg
        self.obs_shape, obs_dtype = self.env.obs_shape, self.env.obs_dtype
        n_actions = self.env.discrete_actions()
        net = policy_value_net(cfg, self.env).to(self.device)
        per_entry = cfg.envs_per_actor
        share = cfg.batch_unrolls // cfg.learners  # this learner's part of each update
        consumer = StreamConsumer(
            self.client_factory(),
            self.keys,
            trajectories(self.keys),
            unroll_schema(self.obs_shape, obs_dtype, n_actions, cfg.unroll, cfg.envs_per_actor),
            count=max(1, share // per_entry),
            block_ms=100,
            claim_idle_ms=cfg.claim_idle_ms,
        )
        self.loader = UnrollLoader(consumer, share, self.device, self.fail)
        self.dropped = 0  # unrolls dropped for exceeding max_policy_lag
        self.lag: list[float] = []
        self._again: UnrollBatch | None = None  # the batch to take another pass over
        self._passes_left = 0
        self.reused = 0  # extra passes taken
        return net

    def optimizer(self) -> torch.optim.Optimizer:
        cfg, params = self.cfg, self.net.parameters()
        if cfg.optimizer == "adam":
            return adam(params, lr=cfg.lr)
        return torch.optim.RMSprop(params, lr=cfg.lr, eps=0.01, alpha=0.99)

    def start_threads(self) -> None:
        self.loader.start()

    def stop_threads(self) -> None:
        self.loader.stop()

    def next_batch(self, timeout: float) -> UnrollBatch | None:
        if self._passes_left and self.loader.batches.empty():  # the learner would wait: reuse
            self._passes_left -= 1  # the last batch (acknowledged after its first pass;
            self.reused += 1  # V-trace corrects for the updates since it was acted)
            return dataclasses.replace(self._again, entries=[])
        b = self.loader.get(timeout)
        if b is None:
            return None
        lag = self.updates - b.versions
        self.lag.extend(lag.tolist())
        limit = self.cfg.max_policy_lag
        if limit and (lag > limit).any():
            keep = torch.from_numpy(lag <= limit).to(self.device)
            self.dropped += int((~keep).sum())
            if not keep.any():
                self.loader.used(b.entries)
                return None
            b = b.select(keep)
        self._again, self._passes_left = b, self.cfg.passes - 1
        return b

    def loss(self, b: UnrollBatch) -> torch.Tensor:
        cfg = self.cfg
        t1, bsz = b.obs.shape[:2]
        logits, values = self.net(b.obs.reshape(t1 * bsz, *self.obs_shape))
        logits = logits.reshape(t1, bsz, -1)[:-1]
        values = values.reshape(t1, bsz)
        reward = b.rewards(self.net, cfg.reward_scale, cfg.gamma)
        discounts = cfg.gamma * (~b.done).float()
        logp = F.log_softmax(logits, dim=-1)
        target_logp = logp.gather(2, b.action[..., None])[..., 0]
        behaviour_logp = F.log_softmax(b.logits, dim=-1).gather(2, b.action[..., None])[..., 0]
        vs, pg_adv = vtrace(
            behaviour_logp,
            target_logp.detach(),
            reward,
            discounts,
            values[:-1].detach(),
            values[-1].detach(),
            cfg.rho_bar,
            cfg.c_bar,
        )
        pg_loss = -(target_logp * pg_adv).mean()
        baseline_loss = 0.5 * ((vs - values[:-1]) ** 2).mean()
        entropy = -(logp.exp() * logp).sum(-1).mean()
        return pg_loss + cfg.baseline_cost * baseline_loss - cfg.entropy_cost * entropy

    def after_step(self, b: UnrollBatch) -> None:
        self.loader.used(b.entries)  # the loader thread acknowledges them, off the gradient path

    def after_skip(self, b: UnrollBatch) -> None:
        # consumed all the same: the same unrolls would give the same loss again, forever
        self._again, self._passes_left = None, 0
        self.loader.used(b.entries)

    def extra_metrics(self) -> dict[str, float]:
        lag, self.lag = self.lag, []
        return {
            "policy_lag": float(np.mean(lag)) if lag else 0.0,
            "policy_lag_max": float(np.max(lag)) if lag else 0.0,
            "dropped": float(self.dropped),
            "reused": float(self.reused),
        }
