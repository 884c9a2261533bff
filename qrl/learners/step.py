"""How a learner's gradient becomes a step: :class:`LocalStep`, its own optimizer's step
(averaged over the pool first); Gorila's learner pushes its gradient to the parameter
server instead (:class:`qrl.learners.gorila.PSStep`). Both clip the gradient's norm to
``grad_clip`` (:class:`qrl.runtime.config.GradientClip`, read at every step: it may change
while the run runs)."""

from __future__ import annotations

import torch

from qrl.learners.group import LearnerGroup
from qrl.learners.rule import Rule
from qrl.runtime.config import Config
from qrl.runtime.loop import StopCheck


class LocalStep:
    """Backward, the gradient averaged over the pool, clipped, one step of the learner's own
    optimizer."""

    def __init__(self) -> None:
        self.allreduce_s = 0.0  # seconds averaging gradients (a pool's)

    def optimizer(self, rule: Rule) -> torch.optim.Optimizer:
        return rule.optimizer()

    def start(self, should_stop: StopCheck) -> bool:
        """Nothing to wait for."""
        return True

    def take(
        self,
        loss: torch.Tensor,
        net: torch.nn.Module,
        opt: torch.optim.Optimizer,
        group: LearnerGroup,
        clip: float,
    ) -> bool:
        """One step on ``loss``; False (no step) if the gradient is not finite. A non-finite
        loss on one learner makes the average non-finite on all of them: they all skip
        together."""
        alone = group.world == 1
        opt.zero_grad(set_to_none=alone)
        loss.backward()
        params = list(net.parameters())
        if not alone:
            self.allreduce_s += group.all_reduce_mean_(group.grads(params))
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if not torch.isfinite(norm):
            opt.zero_grad(set_to_none=True)
            return False
        opt.step()
        return True

    def after(self, updates: int, cfg: Config) -> None:
        """Nothing after an update."""

    def close(self) -> None:
        """Nothing under way."""

    def metrics(self) -> dict[str, float]:
        """None of its own (its all-reduce time is the pool's: ``Learner.group_metrics``)."""
        return {}
