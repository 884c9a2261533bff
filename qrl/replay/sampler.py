"""The learner's samplers: child processes that draw prioritized batches from the Redis
replay ahead of the gradient loop, and write back the priorities the learner gives them.

Sampling and priority writes run in their own processes with their own Redis connections, so
the gradient loop neither waits on Redis nor shares a GIL with the Python work of sampling
(threads in the learner process held it back more than a process does:
notes/benchmarks-notebook.md, "Learners fed through Redis"). ``samplers`` processes draw in
parallel when one cannot keep up, each into its own slots of a ring in shared memory
(:mod:`qrl.replay.ring`), and each writes back the priorities of the batches it drew. The
processes are started with ``spawn``: fresh interpreters that import this module and what it
needs (the replay, the codec and message schemas: numpy, redis, lz4, msgpack, pydantic,
gymnasium; not torch), not forks of a learner with live torch threads and Redis pools. Batches
and priorities are handed over by slot index (local IPC; nothing pickled crosses
Redis).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import redis

from qrl.replay.feed import Feed, feeding
from qrl.replay.ring import BatchRing
from qrl.replay.shards import ShardedReplay
from qrl.replay.store import RecordLayout
from qrl.runtime.background import Background
from qrl.wire import clock
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerSpec:
    """What the sampler process needs (picklable: ``connect`` is e.g. a ``functools.partial``
    of :func:`qrl.wire.connection.connect`)."""

    connect: Callable[[], redis.Redis]
    keys: RunKeys
    layout: RecordLayout
    capacity: int
    mode: Literal["rank", "proportional"]
    alpha: float
    beta: float
    batch_size: int
    learning_starts: int
    seed: int
    shards: int = 1

    def replay(self, seed: int | None = None) -> ShardedReplay:
        return ShardedReplay(
            self.connect(),
            self.keys,
            self.layout,
            self.capacity,
            shards=self.shards,
            mode=self.mode,
            alpha=self.alpha,
            seed=seed,
        )


class Sampler(Feed):
    """The learner's handle on its sampler processes: ``samplers`` of them, filling a ring of
    ``prefetch`` slots (at least one each). ``get`` gives the next batch as a
    :class:`~qrl.replay.store.Sample` whose arrays are in a ring slot (:meth:`release` it
    when done)."""

    def __init__(self, spec: SamplerSpec, samplers: int = 1, prefetch: int = 4) -> None:
        ctx = clock.current().helpers()
        ring = BatchRing(
            ctx, spec.layout.dtype, spec.batch_size, max(prefetch, samplers), owners=samplers
        )
        names = (
            ["sampler process"]
            if samplers == 1
            else [f"sampler process {k}" for k in range(samplers)]
        )
        super().__init__(ctx, ring, _sampler_main, [(spec, k) for k in range(samplers)], names)

    def release(self, slot: int | None, priorities: np.ndarray | None = None) -> None:
        """The learner is done with the batch in ``slot``; its new ``priorities`` (if any)
        go to the replay, and the slot is filled again."""
        self.ring.release(slot, priorities)


def _sampler_main(spec: SamplerSpec, k: int, ring: BatchRing, halt: Any, parent: int) -> None:
    """Sampler process ``k`` (no torch: see the module's docstring): it writes the new
    priorities of the slots given back, then fills them again: every slot given back since
    its last look, in one round trip (at 5 ms from Redis the batches one trip brings bound
    the learner's rate: docs/benchmarks.md, "Many machines")."""
    with feeding(ring, parent):
        replay = spec.replay(seed=spec.seed + 1_000_003 * k)
        ids: dict[int, list[bytes]] = {}  # of the batch in each of this sampler's slots

        def write_back(given: list[tuple[int, bool | None]]) -> Callable[[], None]:
            """The update of the priorities the learner left in the ``given`` slots (read
            now: the slots are filled again next), in one round trip, to run."""
            batches, prios = [], []
            for slot, has_priorities in given:
                batch = ids.pop(slot, [])
                if has_priorities and batch:
                    batches += batch
                    prios.append(ring.view(slot)["priority"][: len(batch)].astype(np.float64))
            if not batches:
                return lambda: None
            new = np.concatenate(prios)  # a copy

            def update() -> None:
                try:
                    replay.update_priorities(batches, new)
                except redis.RedisError:
                    log.exception("priority update failed")

            return update

        writing = Background("priorities")
        started = False  # the replay held learning_starts items (then it is not asked again)
        while not halt.is_set():
            if not started and replay.size() < spec.learning_starts:
                clock.sleep(0.05)
                continue
            started = True
            if (first := ring.take(k, timeout=0.1)) is None:
                continue
            given = [first]
            while (more := ring.take(k, timeout=0)) is not None:
                given.append(more)
            # the priorities go back while the next batches are drawn (one round trip, not
            # two, for a learner far from Redis); the ones before are waited for first
            writing.submit(write_back(given))
            slots = [slot for slot, _ in given]
            while slots and not halt.is_set():
                drawn = replay.samples(spec.batch_size, spec.beta, [ring.view(s) for s in slots])
                for slot, sample in zip(slots, drawn, strict=True):
                    if sample is not None:
                        ids[slot] = sample.ids
                        ring.put(slot, sample)
                slots = [slot for slot, sample in zip(slots, drawn, strict=True) if sample is None]
                if slots:  # all it drew was removed (see qrl.replay.store.screen)
                    clock.sleep(0.01)
        writing.close()
        last = []
        while (given := ring.take(k, timeout=0)) is not None:  # the last priorities
            last.append(given)
        write_back(last)()
