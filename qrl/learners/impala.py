"""The IMPALA learner's parts: batches of unrolls from the trajectory stream (the loader's
:class:`qrl.learners.unrolls.UnrollSource`, consumer group), their policy lag measured and
those older than ``max_policy_lag`` dropped (:class:`Lag`), further passes over a batch
while no fresh one waits (:class:`Passes`); the update rule (:class:`ImpalaRule`): V-trace
targets, policy-gradient + baseline + entropy loss. Entries are acknowledged only after the
update that used them."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.vtrace import vtrace
from qrl.learners.base import adam
from qrl.learners.loader import Loader
from qrl.learners.rule import Rule, Update
from qrl.learners.unrolls import UnrollBatch, UnrollSource
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import policy_value_net

log = logging.getLogger(__name__)

# the loader reads ahead while the learner can take more passes over its last batch: on a
# machine it shares with actors, that read-ahead gives way to them as they give way to the
# learner (qrl train's --actor-nice default; notes/benchmarks-notebook.md, "The loader's
# niceness")
LOADER_NICE = 10


class Lag:
    """Counts each unroll's policy lag (the learner's updates minus the unroll's version)
    and drops those more than ``limit`` updates old (0: none)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.dropped = 0  # unrolls dropped for exceeding max_policy_lag
        self.lag: list[float] = []

    def __call__(self, b: UnrollBatch, updates: int) -> UnrollBatch | None:
        lag = updates - b.versions
        self.lag.extend(lag.tolist())
        if self.limit and (lag > self.limit).any():
            keep = torch.from_numpy(lag <= self.limit).to(b.obs.device)
            self.dropped += int((~keep).sum())
            if not keep.any():
                return None
            b = b.select(keep)
        return b

    def metrics(self) -> dict[str, float]:
        lag, self.lag = self.lag, []
        return {
            "policy_lag": float(np.mean(lag)) if lag else 0.0,
            "policy_lag_max": float(np.max(lag)) if lag else 0.0,
            "dropped": float(self.dropped),
        }


class Passes:
    """``source``'s batches, each given for up to ``passes`` updates: the last batch again
    when no fresh one waits (acknowledged after its first pass; V-trace corrects for the
    updates since it was acted)."""

    def __init__(self, source: UnrollSource, passes: int) -> None:
        self.source, self.passes = source, passes
        self.again: UnrollBatch | None = None  # the batch to take another pass over
        self.left = 0
        self.reused = 0  # extra passes taken

    @property
    def transfer_s(self) -> float:
        return self.source.transfer_s

    @property
    def feed(self) -> Loader | None:
        return self.source.feed

    def start(self, fail: Callable[[str], None]) -> None:
        self.source.start(fail)

    def stop(self) -> None:
        self.source.stop()

    def next(self, timeout: float, updates: int) -> UnrollBatch | None:
        if self.left and not self.source.waiting():  # the learner would wait: reuse the last
            self.left -= 1
            self.reused += 1
            return self.again
        b = self.source.next(timeout, updates)
        if b is not None:
            self.again, self.left = b, self.passes - 1
        return b

    def done(self, b: UnrollBatch, update: Update | None) -> None:
        if update is None:  # no step: the same unrolls would give the same loss again
            self.again, self.left = None, 0
        elif self.left and b.slot is not None:  # another pass may come after its slot is
            self.again = b.own()  # filled again
        self.source.done(b, update)  # the loader acknowledges its entries, off the gradient path

    def metrics(self) -> dict[str, float]:
        return {**self.source.metrics(), "reused": float(self.reused)}


class ImpalaRule(Rule):
    def __init__(self, cfg: ImpalaConfig, env: EnvSpec, device: torch.device) -> None:
        self.cfg, self.obs_shape = cfg, env.obs_shape
        self.net = policy_value_net(cfg, env).to(device)

    def optimizer(self) -> torch.optim.Optimizer:
        cfg, params = self.cfg, self.net.parameters()
        if cfg.optimizer == "adam":
            return adam(params, lr=cfg.lr)
        return torch.optim.RMSprop(params, lr=cfg.lr, eps=0.01, alpha=0.99)

    def loss(self, b: UnrollBatch, updates: int) -> Update:
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
        return Update(pg_loss + cfg.baseline_cost * baseline_loss - cfg.entropy_cost * entropy)
