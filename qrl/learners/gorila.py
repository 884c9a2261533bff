"""The Gorila learner (Nair et al. 2015): one of ``learners`` processes that each sample the
prioritized replay, compute the double-DQN gradient (:class:`qrl.learners.dqn.DQNLearner`)
on the parameters they last pulled from the parameter server (:mod:`qrl.ps`) and push it
there instead of stepping an optimizer. The target network takes the pulled parameters
every ``target_update`` versions of them. The servers publish the weights and write the
checkpoint; a learner keeps nothing of its own (a restarted one pulls and goes on)."""

from __future__ import annotations

from typing import Any

import torch

from qrl.learners.dqn import DQNLearner
from qrl.learners.replay import Batch
from qrl.ps.client import PSClient
from qrl.runtime.algorithm import RoleContext
from qrl.runtime.loop import StopCheck
from qrl.wire.weights import wait_for_weights


def _never() -> bool:
    return False


class GorilaLearner(DQNLearner):
    algo = "gorila"
    ident = 0
    ps: PSClient
    should_stop: StopCheck = _never

    @classmethod
    def from_context(cls, ctx: RoleContext) -> GorilaLearner:
        learner = super().from_context(ctx)
        assert isinstance(learner, GorilaLearner)
        learner.ident = ctx.ident
        return learner

    def optimizer(self) -> torch.optim.Optimizer:
        # never stepped (the servers step theirs): the base zeroes gradients with it and
        # reports its learning rate
        return torch.optim.SGD(self.net.parameters(), lr=self.cfg.lr)

    def sample_seed(self) -> int:
        return self.cfg.seed * 1000 + self.ident

    def start(self, should_stop: StopCheck) -> bool:
        cfg = self.cfg
        self.ps = PSClient(self.client, self.keys, cfg, self.net, self.ident, cfg.learners)
        if not wait_for_weights(self.ps.pull, should_stop):
            return False
        self.target_version = min(self.ps.versions)
        self.start_threads()  # the target network starts as the pulled one
        return True

    def step(self, should_stop: StopCheck) -> bool:
        self.should_stop = should_stop
        return super().step(should_stop)

    def step_on(self, loss: torch.Tensor) -> bool:
        """Backward, clipped, and pushed to the servers (not stepped here); False if the
        gradient is not finite."""
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.cfg.grad_clip)
        if not torch.isfinite(norm):
            return False
        self.ps.push(float(loss), self.should_stop)  # (not sent if stopped while waiting)
        return True

    def after_step(self, b: Batch) -> None:
        self.keep_priorities(b)
        if self.updates % self.cfg.pull_every == 0:
            self.ps.pull()
        if min(self.ps.versions) - self.target_version >= self.cfg.target_update:
            self.target.load_state_dict(self.net.state_dict())
            self.target_version = min(self.ps.versions)

    def publish(self) -> None:
        """Nothing: the parameter server publishes."""

    def save(self) -> None:
        """Nothing: the parameter server writes the checkpoint."""

    def close(self, should_stop: StopCheck) -> None:
        self.stopping.set()
        self.stop_threads()

    def extra_metrics(self) -> dict[str, Any]:
        return {
            **super().extra_metrics(),
            "version": min(self.ps.versions),
            "backpressure_s": self.ps.waited_s(),
        }
