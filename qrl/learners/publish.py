"""A learner's weights publisher: the leader of the pool publishes the rule's published
module (:meth:`qrl.learners.rule.Rule.published`) through the run's
:class:`~qrl.wire.weights.WeightStore`, never parameters that are not finite, and carries
on above a version another writer stored (see :meth:`WeightStore.publish`)."""

from __future__ import annotations

import logging

import torch

from qrl.learners.resume import settle
from qrl.wire.weights import WeightStore

log = logging.getLogger(__name__)


class Publisher:
    """Publishes every ``every`` updates (and whenever the learner asks: at its start, its
    close, after another writer's blob)."""

    def __init__(self, weights: WeightStore, every: int = 1) -> None:
        self.weights, self.every = weights, every

    def publish(self, module: torch.nn.Module, updates: int) -> int:
        """``module`` as version ``updates``; the version the learner counts on from (above
        another writer's newer one). Parameters that are not finite are not published."""
        if not all(torch.isfinite(p).all() for p in module.parameters()):
            log.error("parameters at update %d are not finite: not published", updates)
            return updates
        return self.weights.publish(module, version=updates)

    def due(self, updates: int) -> bool:
        """Whether update ``updates`` is published."""
        return updates % self.every == 0

    def settle(self, module: torch.nn.Module, updates: int) -> tuple[int, bool]:
        """The learner's version once the published weights are taken into account, and
        whether it must publish its own first (:func:`qrl.learners.resume.settle`)."""
        return settle(self.weights, module, updates)

    def kept(self) -> bool:
        """Whether the weights are still the ones published last (False: another writer's
        blob took their place: actors that rejected it wait for a new version)."""
        return self.weights.kept()

    def behind(self, updates: int) -> bool:
        """Whether the stored version is below ``updates`` (or another's)."""
        return self.weights.version() != updates

    def stale(self, updates: int) -> bool:
        """Whether the stored version is older than ``updates``."""
        return self.weights.version() < updates
