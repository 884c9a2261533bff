"""The weights client of an actor that acts with its own network: a local copy of the
learner's published network (:class:`qrl.wire.weights.WeightStore`), its version, and a
look for newer weights every ``weight_poll`` units (:class:`qrl.actors.actor.Actor`)."""

from __future__ import annotations

import time
from typing import Any

import redis
import torch

from qrl.runtime.loop import StopCheck
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore, wait_for_weights


class Weights:
    """Loads the run's published weights into ``net``; ``poll``: units between two looks."""

    def __init__(self, client: redis.Redis, keys: RunKeys, net: torch.nn.Module, poll: int) -> None:
        self.store, self.net, self.poll = WeightStore(client, keys), net, poll
        self.version = -1
        self.units = 0  # units of work done (vector steps, unrolls)
        self.loads, self.load_s = 0, 0.0  # weights loaded, and the seconds that took

    def wait(self, should_stop: StopCheck, timeout: float = 600) -> bool:
        """Block until the learner published weights (:func:`qrl.wire.weights.wait_for_weights`)."""
        return wait_for_weights(self.refresh, should_stop, timeout)

    def refresh(self) -> bool:
        """Load newer weights if the learner published some (one HGET when not)."""
        t0 = time.monotonic()
        v = self.store.load_into(self.net, newer_than=self.version)
        if v is None:
            return False
        self.version = v
        self.loads += 1
        self.load_s += time.monotonic() - t0  # fetched, checked and loaded: what acting waits
        return True

    def ready(self, should_stop: StopCheck) -> bool:
        return True

    def done(self) -> None:
        self.units += 1
        if self.units % self.poll == 0:
            self.refresh()

    def metrics(self) -> dict[str, Any]:
        return {"version": self.version, "weight_loads": self.loads, "weight_load_s": self.load_s}


def local_net(net: torch.nn.Module) -> torch.nn.Module:
    """``net`` as an actor holds it: in evaluation mode, run with one torch thread (an actor
    process shares its machine with many)."""
    torch.set_num_threads(1)
    net.eval()
    return net
