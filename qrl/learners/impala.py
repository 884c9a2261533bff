"""The IMPALA learner: batches of unrolls from the trajectory stream (consumer group),
V-trace targets, policy-gradient + baseline + entropy loss; entries are acknowledged only
after the update that used them.

A loader process reads and decodes entries and stacks them into batches in shared memory
while the learner computes gradients (:mod:`qrl.learners.loader`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import unroll_schema
from qrl.algos.impala.vtrace import vtrace
from qrl.learners.base import adam
from qrl.learners.unrolls import UnrollBatch, UnrollLearner
from qrl.rl.models import policy_value_net

log = logging.getLogger(__name__)


class ImpalaLearner(UnrollLearner):
    algo = "impala"
    stream = trajectories
    schema = unroll_schema
    # the loader reads ahead while the learner can take more passes over its last batch: on
    # a machine it shares with actors, that read-ahead gives way to them as they give way to
    # the learner (qrl train's --actor-nice default; docs/benchmarks.md, "The loader's
    # niceness")
    loader_nice = 10

    def build(self) -> torch.nn.Module:
        self.obs_shape = self.env.obs_shape
        net = policy_value_net(self.cfg, self.env).to(self.device)
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

    def next_batch(self, timeout: float) -> UnrollBatch | None:
        waiting = lambda: self.feed is not None and self.feed.waiting()  # noqa: E731
        if self._passes_left and not waiting():  # the learner would wait: reuse the last batch
            self._passes_left -= 1  # (acknowledged after its first pass; V-trace corrects
            self.reused += 1  # for the updates since it was acted)
            return self._again
        b = self.take(timeout)
        return None if b is None else self.admit(b)

    def admit(self, b: UnrollBatch) -> UnrollBatch | None:
        """The batch to train on: its policy lag counted, unrolls older than
        ``max_policy_lag`` dropped (``None`` if none is left), kept for more passes."""
        lag = self.updates - b.versions
        self.lag.extend(lag.tolist())
        limit = self.cfg.max_policy_lag
        if limit and (lag > limit).any():
            keep = torch.from_numpy(lag <= limit).to(self.device)
            self.dropped += int((~keep).sum())
            if not keep.any():
                self.used(b)
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
        if self._passes_left and b.slot is not None:  # another pass may come after its slot
            self._again = b.own()  # is filled again
        self.used(b)  # the loader process acknowledges its entries, off the gradient path

    def after_skip(self, b: UnrollBatch) -> None:
        # consumed all the same: the same unrolls would give the same loss again, forever
        self._again, self._passes_left = None, 0
        self.used(b)

    def extra_metrics(self) -> dict[str, float]:
        lag, self.lag = self.lag, []
        return {
            "policy_lag": float(np.mean(lag)) if lag else 0.0,
            "policy_lag_max": float(np.max(lag)) if lag else 0.0,
            "dropped": float(self.dropped),
            "reused": float(self.reused),
        }
