"""The learner's samplers: child processes that draw prioritized batches from the Redis
replay ahead of the gradient loop, and write back the priorities the learner gives them.

Sampling and priority writes run in their own processes with their own Redis connections,
so the gradient loop neither waits on Redis nor shares a GIL with the Python work of
sampling (threads in the learner process held it back more than a process does:
docs/benchmarks.md, "Learners fed through Redis"). ``samplers`` processes draw in parallel
when one cannot keep up, each into its own slots of a ring in shared memory
(:mod:`qrl.replay.ring`), and each writes back the priorities of the batches it drew. The
processes are started with ``spawn``: fresh interpreters that import this module and what
it needs (the replay, the codec and message schemas: numpy, redis, lz4, msgpack, pydantic,
gymnasium; not torch), not forks of a learner with live torch threads and Redis pools.
Batches and priorities are handed over by slot index (local IPC; nothing pickled crosses
Redis).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import redis

from qrl.replay.ring import BatchRing
from qrl.replay.shards import ShardedReplay
from qrl.replay.store import RecordLayout, Sample
from qrl.server.embedded import signal_on_parent_death
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


class Sampler:
    """The learner's handle on its sampler processes: ``samplers`` of them, filling a ring of
    ``prefetch`` slots (at least one each)."""

    def __init__(self, spec: SamplerSpec, samplers: int = 1, prefetch: int = 4) -> None:
        ctx = multiprocessing.get_context("spawn")
        slots = max(prefetch, samplers)
        self.ring = BatchRing(ctx, spec.layout.dtype, spec.batch_size, slots, owners=samplers)
        self._halt = ctx.Event()
        self._procs = [
            ctx.Process(
                target=_sampler_main,
                args=(spec, k, self.ring, self._halt, os.getpid()),
                name=f"sampler{k}",
                daemon=True,
            )
            for k in range(samplers)
        ]
        for p in self._procs:
            p.start()
        self._checked = 0.0  # when the processes were last seen alive

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def get(self, timeout: float) -> Sample | None:
        """The next batch (its arrays in a ring slot: :meth:`release` it when done), ``None``
        if none came within ``timeout``; raises ``RuntimeError`` if a sampler process died
        or failed."""
        now = time.monotonic()
        if now > self._checked + 1.0:  # (a syscall each: not on every update)
            self._checked = now
            for p in self._procs:
                if not p.is_alive():
                    raise RuntimeError(f"sampler process {p.name} (exit code {p.exitcode})")
        item = self.ring.get(timeout)
        if item is None:
            self._checked = 0.0  # none came: look again at once
        if isinstance(item, str):  # a sampler's last words
            raise RuntimeError(f"sampler process: {item}")
        return item

    def release(self, slot: int | None, priorities: np.ndarray | None = None) -> None:
        """The learner is done with the batch in ``slot``; its new ``priorities`` (if any)
        go to the replay, and the slot is filled again."""
        self.ring.release(slot, priorities)

    def stop(self) -> None:
        """Write the priorities given back so far, then end the processes."""
        self._halt.set()
        deadline = time.monotonic() + 10
        for p in self._procs:
            while p.is_alive() and time.monotonic() < deadline:
                self.ring.full.get(0.05)  # a sampler waiting to hand a batch over can stop
            if p.is_alive():
                p.terminate()


def _sampler_main(spec: SamplerSpec, k: int, ring: BatchRing, halt: Any, parent: int) -> None:
    """Sampler process ``k`` (no torch: see the module's docstring): it writes the new
    priorities of each of its slots given back, then fills the slot again."""
    signal_on_parent_death(signal.SIGKILL)  # a SIGKILLed learner must not leave it behind
    if os.getppid() != parent:  # the learner died before that took effect
        os._exit(1)
    try:
        replay = spec.replay(seed=spec.seed + 1_000_003 * k)
        ids: dict[int, list[bytes]] = {}  # of the batch in each of this sampler's slots

        def write_back(slot: int, has_priorities: bool | None) -> None:
            batch = ids.pop(slot, [])
            if has_priorities and batch:
                prios = ring.view(slot)["priority"][: len(batch)].astype(np.float64)
                try:
                    replay.update_priorities(batch, prios)
                except redis.RedisError:
                    log.exception("priority update failed")

        started = False  # the replay held learning_starts items (then it is not asked again)
        while not halt.is_set():
            if not started and replay.size() < spec.learning_starts:
                time.sleep(0.05)
                continue
            started = True
            if (given := ring.take(k, timeout=0.1)) is None:
                continue
            slot = given[0]
            write_back(*given)
            while not halt.is_set():
                s = replay.sample(spec.batch_size, spec.beta, out=ring.view(slot))
                if s is None:  # all it drew was removed (see qrl.replay.store.screen)
                    time.sleep(0.01)
                    continue
                ids[slot] = s.ids
                ring.put(slot, s)
                break
        while (given := ring.take(k, timeout=0)) is not None:  # the last priorities
            write_back(*given)
    except Exception as e:
        log.exception("sampler failed")
        with contextlib.suppress(Exception):
            ring.last_words(f"{type(e).__name__}: {e}")
        raise
