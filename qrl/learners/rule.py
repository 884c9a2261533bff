"""A learner's update rule (one per algorithm): its network(s) and optimizer, and a batch
made a loss. :class:`qrl.learners.base.Learner` runs every rule the same way: for each part
of a batch (:meth:`Rule.parts`: the batch itself, or PPO's minibatches) the loss, the step
(:mod:`qrl.learners.step`), then :meth:`Rule.after_step` once per update. What the loss
gives back beyond the loss (Ape-X's new priorities) is returned in an :class:`Update`,
never stored on the batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from qrl.learners.group import LearnerGroup
from qrl.runtime.config import Config


class Update(NamedTuple):
    """What one part's loss gives: the loss, and the new priorities of the batch's items
    (replay rules; ``None`` otherwise)."""

    loss: torch.Tensor
    priorities: torch.Tensor | None = None


class Rule:
    """An update rule's defaults. A rule sets ``net`` and ``cfg`` (which a live config change
    replaces: :meth:`reconfigure`) and implements :meth:`optimizer` and :meth:`loss`."""

    net: torch.nn.Module
    cfg: Config
    # whether an update whose every step was skipped still counts (PPO: its batch is spent,
    # and the update count paces its actors)
    counts_skipped = False

    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of ``self.net`` (made late: see ``Learner.opt``)."""
        raise NotImplementedError

    def learning_rates(self) -> list[float]:
        """The learning rate of each of the optimizer's parameter groups: ``cfg.lr``
        (:class:`qrl.runtime.config.LearningRate`) for one group by default."""
        return [self.cfg.lr]

    def published(self) -> torch.nn.Module:
        """What actors need and the weights carry: the whole network unless a rule
        publishes less (Ape-X DPG: the actor network, its names as in ``self.net``)."""
        return self.net

    def begin(self) -> None:
        """Called as the learner starts, once its network holds what it resumed or pulled
        (the replay rules: the target network copied)."""

    def parts(self, batch: Any, group: LearnerGroup) -> Iterator[Any]:
        """What one update steps on, one optimizer step each: the batch itself by default
        (PPO: epochs x minibatches)."""
        yield batch

    def loss(self, part: Any, updates: int) -> Update:
        """The loss of one part, at ``updates`` updates made so far."""
        raise NotImplementedError

    def after_step(self, updates: int, steps: int) -> None:
        """After an update (the ``updates``-th) of ``steps`` optimizer steps: target
        networks."""

    def metrics(self) -> dict[str, float]:
        """The rule's own values for the metrics report (taken: reset where they are
        averages since the last report)."""
        return {}

    def reconfigure(self, cfg: Config) -> None:
        """A live config change: later losses read ``cfg``."""
        self.cfg = cfg
