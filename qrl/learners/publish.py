"""A learner's weights publisher: the leader of the pool publishes the rule's published
module (:meth:`qrl.learners.rule.Rule.published`) through the run's
:class:`~qrl.wire.weights.WeightStore`, never parameters that are not finite, and carries
on above a version another writer stored (see :meth:`WeightStore.publish`).

The publication itself (encoding, the round trip, the transfer) runs on a thread of its own
(:class:`qrl.runtime.background.Background`) while the learner trains on: it takes a copy of
the parameters (the next steps change them in place), and a version another writer forced
is published above at the next publication. An update's publication that comes while the
one before is still under way is not waited for: it is owed, and made (with the parameters
and version of then) at the learner's first step after that one is back. Far from Redis a
publication is a round trip, about as long as an update of a small network (IMPALA
publishes every update): waiting for it held the learner back."""

from __future__ import annotations

import logging

import numpy as np
import torch

from qrl.learners.resume import settle
from qrl.runtime.background import Background
from qrl.wire.weights import WeightStore, module_arrays

log = logging.getLogger(__name__)


class Publisher:
    """Publishes every ``every`` updates (and whenever the learner asks: at its start, its
    close, after another writer's blob)."""

    def __init__(self, weights: WeightStore, every: int = 1) -> None:
        self.weights, self.every = weights, every
        self.sending = Background("publish")
        self.went: tuple[int, int] | None = None  # the last publication's: asked, stored
        self.owed = False  # an update's publication skipped while one was under way

    def publish(self, module: torch.nn.Module, updates: int, wait: bool = True) -> int:
        """``module`` as version ``updates``, or above the version another writer forced on
        the publication before; the version the learner counts on from. Without ``wait``
        it is published while the learner trains on, and skipped (owed: :meth:`owes`) while
        the one before is. Parameters that are not finite are not published."""
        self.owed = not wait and self.sending.busy
        if self.owed:
            return updates
        if not all(torch.isfinite(p).all() for p in module.parameters()):
            log.error("parameters at update %d are not finite: not published", updates)
            return updates
        self._finish()
        arrays = module_arrays(module)
        if not self.sending.in_line:  # published while the next steps change them in place
            arrays = {k: np.array(v, copy=True) for k, v in arrays.items()}
        if self.went is not None and self.went[1] > self.went[0]:  # went above another's
            updates = max(updates, self.went[1] + 1)
        self.went = None

        def publish() -> tuple[int, int]:
            return updates, self.weights.publish(arrays, version=updates)

        done = self.sending.submit(publish)
        if self.sending.ran_in_line:
            return done[1]
        return self.settled(updates) if wait else updates

    def _finish(self) -> None:
        """Wait for the publication under way; keep where it went."""
        done = self.sending.wait()
        if done is not None:
            self.went = done

    def settled(self, updates: int) -> int:
        """Wait for the publication under way; the version the learner counts on from:
        where version ``updates`` went, if that was the one."""
        self._finish()
        if self.went is not None and self.went[0] == updates:
            updates, self.went = self.went[1], None
        return updates

    def owes(self) -> bool:
        """Whether a publication skipped while one was under way is due, that one done."""
        return self.owed and not self.sending.busy

    def close(self) -> None:
        self._finish()
        self.sending.close()

    def due(self, updates: int) -> bool:
        """Whether update ``updates`` is published."""
        return updates % self.every == 0

    def settle(self, module: torch.nn.Module, updates: int) -> tuple[int, bool]:
        """The learner's version once the published weights are taken into account, and
        whether it must publish its own first (:func:`qrl.learners.resume.settle`)."""
        self._finish()
        return settle(self.weights, module, updates)

    def kept(self) -> bool:
        """Whether the weights are still the ones published last (False: another writer's
        blob took their place: actors that rejected it wait for a new version)."""
        return self.weights.kept()

    def behind(self, updates: int) -> bool:
        """Whether the stored version is below ``updates`` (or another's)."""
        self._finish()
        return self.weights.version() != updates

    def stale(self, updates: int) -> bool:
        """Whether the stored version is older than ``updates``."""
        self._finish()
        return self.weights.version() < updates
