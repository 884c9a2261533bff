"""The Gorila learner's step (Nair et al. 2015): one of ``learners`` processes that each
sample the prioritized replay, compute the double-DQN gradient
(:class:`qrl.learners.dqn.DQNRule`) on the parameters they last pulled from the parameter
server (:mod:`qrl.ps`) and push it there instead of stepping an optimizer
(:class:`PSStep`). The target network takes the pulled parameters every ``target_update``
versions of them. The servers publish the weights and write the checkpoint; a learner keeps
nothing of its own (a restarted one pulls and goes on): its builder passes no publisher and
no checkpointer."""

from __future__ import annotations

import redis
import torch

from qrl.algos.gorila.config import GorilaConfig
from qrl.learners.dqn import DQNRule
from qrl.learners.group import LearnerGroup
from qrl.learners.rule import Rule
from qrl.ps.client import PSClient
from qrl.runtime.loop import StopCheck
from qrl.wire.keys import RunKeys
from qrl.wire.weights import wait_for_weights


def _never() -> bool:
    return False


class PSStep:
    """A gradient pushed to the parameter server (learner ``ident`` of ``cfg.learners``), the
    parameters pulled every ``pull_every`` updates, ``rule``'s target network synced."""

    allreduce_s = 0.0  # (never in a pool)

    def __init__(
        self, client: redis.Redis, keys: RunKeys, cfg: GorilaConfig, rule: DQNRule, ident: int
    ) -> None:
        self.client, self.keys, self.cfg, self.rule, self.ident = client, keys, cfg, rule, ident
        self.should_stop: StopCheck = _never
        self.ps: PSClient | None = None
        self.target_version = -1

    def optimizer(self, rule: Rule) -> torch.optim.Optimizer:
        # never stepped (the servers step theirs): the learner zeroes gradients with it and
        # reports its learning rate
        return torch.optim.SGD(rule.net.parameters(), lr=self.cfg.lr)

    def start(self, should_stop: StopCheck) -> bool:
        """The first pull: False if stopped before the servers published."""
        cfg, self.should_stop = self.cfg, should_stop
        self.ps = PSClient(self.client, self.keys, cfg, self.rule.net, self.ident, cfg.learners)
        if not wait_for_weights(self.ps.pull, should_stop):
            return False
        self.target_version = min(self.ps.versions)
        return True  # (the target network starts as the pulled one: DQNRule.begin)

    def take(
        self,
        loss: torch.Tensor,
        net: torch.nn.Module,
        opt: torch.optim.Optimizer,
        group: LearnerGroup,
        clip: float,
    ) -> bool:
        """Backward, clipped, and pushed to the servers (not stepped here); False if the
        gradient is not finite."""
        assert self.ps is not None
        opt.zero_grad(set_to_none=False)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        if not torch.isfinite(norm):
            return False
        self.ps.push(loss.item(), self.should_stop)  # (not sent if stopped while waiting)
        return True

    def after(self, updates: int, cfg: GorilaConfig) -> None:
        assert self.ps is not None
        if updates % cfg.pull_every == 0:
            self.ps.pull()
        if min(self.ps.versions) - self.target_version >= cfg.target_update:
            self.rule.sync_target()
            self.target_version = min(self.ps.versions)

    def close(self) -> None:
        """Wait for the push under way."""
        if self.ps is not None:
            self.ps.close()

    def metrics(self) -> dict[str, float]:
        if self.ps is None:
            return {}
        return {"version": min(self.ps.versions), "backpressure_s": self.ps.waited_s()}
