"""The weights client of an actor that acts with its own network: a local copy of the
learner's published network (:class:`qrl.wire.weights.WeightStore`), its version, and a
look for newer weights every ``weight_poll`` units (:class:`qrl.actors.actor.Actor`).

Where Redis is far (:class:`qrl.runtime.background.Background`: looks that take a
millisecond or more), a look fetches on a thread of its own while the actor acts on, and the
weights it brought are loaded between the next two steps after it finished
(:meth:`Weights.fresh`); near Redis a look runs in line and its weights are loaded at once.
An actor far from Redis so acts on through the round trips of the version check and the
blob's transfer, and only the load into its network (local, fast) holds it up. A look that
outlasts a unit (two round trips at 5 ms often outlast a CartPole unroll) is not waited for:
the next one starts at the first unit's end after it is back. (PPO's paced actors count
versions as they load them, and look in line: :class:`qrl.actors.ppo.PacedWeights`; in a
one-process run every look is in line.)"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
import torch

from qrl.runtime.background import Background
from qrl.runtime.loop import StopCheck
from qrl.wire.codec import CodecError
from qrl.wire.keys import RunKeys
from qrl.wire.weights import Unfit, WeightStore, fitting, load_arrays, wait_for_weights
from qrl.wire.weights import Weights as Published

log = logging.getLogger(__name__)


class Weights:
    """Loads the run's published weights into ``net``; ``poll``: units between two looks."""

    ahead = True  # whether a look fetches while the actor acts on

    def __init__(self, client: redis.Redis, keys: RunKeys, net: torch.nn.Module, poll: int) -> None:
        self.store, self.net, self.poll = WeightStore(client, keys), net, poll
        self.fit = fitting(net)
        self.version = -1
        self.units = 0  # units of work done (vector steps, unrolls)
        self.loads = 0  # weights loaded
        self.load_s = 0.0  # seconds acting waited for weights (in line: the whole look)
        self.fetch_s = 0.0  # seconds fetching them (fetched ahead: off the acting path)
        self.looking = Background("weights")
        self.looked: tuple[int, Published | None, float] | None = None  # from, what, seconds

    def wait(self, should_stop: StopCheck, timeout: float = 600) -> bool:
        """Block until the learner published weights (:func:`qrl.wire.weights.wait_for_weights`)."""
        return wait_for_weights(self.refresh, should_stop, timeout)

    def refresh(self) -> bool:
        """Load newer weights if the learner published some (one HGET when not), in line."""
        t0, since = time.monotonic(), self.version
        w = self._fetch(since)
        took = time.monotonic() - t0
        self.load_s += took  # what acting waited for (the load's own time added below)
        return self._load(since, w, took)

    def _fetch(self, since: int) -> Published | None:
        """The published weights if newer than ``since`` and fit for the network (a misfit
        is refused from the manifest, before its chunks are read)."""
        try:
            return self.store.fetch(since, self.fit)
        except Unfit as e:
            log.warning("published weights do not fit the model: %s", e)
            return None

    def ready(self, should_stop: StopCheck) -> bool:
        return True

    def fresh(self) -> None:
        """Between two steps: load what a look brought, if it is back."""
        if self.looked is not None:
            looked, self.looked = self.looked, None
            self._load(*looked)

    def done(self) -> None:
        """A unit was pushed: look again when one is due."""
        self.units += 1
        self.fresh()
        if self.units % self.poll == 0:
            if not self.ahead:
                self.refresh()
                return
            if self.looking.busy:  # the look under way brings the newest weights it finds:
                return  # acting does not wait for it to look again
            self.looking.submit(self._look)
            if self.looking.ran_in_line:  # loaded at once, as acting waited for it
                self.load_s += self.looked[2] if self.looked else 0.0
                self.fresh()

    def _look(self) -> bool:
        """On the looking thread: fetch what is newer than the version loaded now, for
        :meth:`fresh` to load."""
        t0, since = time.monotonic(), self.version
        self.looked = (since, self._fetch(since), time.monotonic() - t0)
        return True

    def _load(self, since: int, w: Published | None, fetch_s: float) -> bool:
        """Load weights fetched as newer than ``since``, unless there were none or the actor
        loaded others since (a rate limit's wait loads in line); whether it did."""
        self.fetch_s += fetch_s
        if w is None or since != self.version:
            return False
        t0 = time.monotonic()
        try:
            load_arrays(self.net, w.params)
        except CodecError as e:
            log.warning("weights version %d do not fit the model: %s", w.version, e)
            return False
        self.version = w.version
        self.loads += 1
        self.load_s += time.monotonic() - t0
        return True

    def close(self) -> None:
        """Stop looking (waits for a look under way)."""
        self.looking.close()

    def metrics(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "weight_loads": self.loads,
            "weight_load_s": self.load_s,
            "weight_fetch_s": self.fetch_s,
        }


def local_net(net: torch.nn.Module) -> torch.nn.Module:
    """``net`` as an actor holds it: in evaluation mode, run with one torch thread (an actor
    process shares its machine with many)."""
    torch.set_num_threads(1)
    net.eval()
    return net
