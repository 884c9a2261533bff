"""The learner's sampler: a child process that draws prioritized batches from the Redis
replay ahead of the gradient loop and writes back the priorities the learner sends.

Sampling and priority writes run in their own process with their own Redis connections, so
the gradient loop neither waits on Redis nor shares a GIL with the Python work of sampling
(threads in the learner process held it back more than the process does: docs/benchmarks.md,
"Learners fed through Redis"). The process is started with ``spawn``: a fresh interpreter
that imports this module and what it needs (the replay, the codec and message schemas:
numpy, redis, lz4, msgpack, pydantic, gymnasium; not torch), not a fork of a learner with
live torch threads and Redis pools. Batches come over a multiprocessing queue (local IPC;
nothing pickled crosses Redis).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import redis

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
    """The learner's handle on its sampler process."""

    def __init__(self, spec: SamplerSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._samples: Any = ctx.Queue(4)
        self._priorities: Any = ctx.Queue(64)
        self._halt = ctx.Event()
        self._proc = ctx.Process(
            target=_sampler_main,
            args=(spec, self._samples, self._priorities, self._halt, os.getpid()),
            name="sampler",
            daemon=True,
        )
        self._proc.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def get(self, timeout: float) -> Sample | None:
        """The next batch, ``None`` if none came within ``timeout``; raises ``RuntimeError``
        if the sampler process died or failed."""
        if not self._proc.is_alive():
            raise RuntimeError(f"sampler process (exit code {self._proc.exitcode})")
        try:
            item = self._samples.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, str):  # the sampler's last words
            raise RuntimeError(f"sampler process: {item}")
        return item

    def send_priorities(self, ids: list[bytes], priorities: np.ndarray) -> None:
        try:  # if the sampler is far behind, drop an update rather than block the learner
            self._priorities.put((ids, priorities), timeout=5)
        except queue.Full:
            log.warning("priority writer is behind: dropped one batch of priority updates")

    def stop(self) -> None:
        """Write the priorities sent so far, then end the process."""
        self._halt.set()
        with contextlib.suppress(queue.Full):
            self._priorities.put(None, timeout=5)  # after the last priorities: write, then end
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()


def _sampler_main(
    spec: SamplerSpec,
    samples: Any,
    priorities: Any,
    halt: Any,
    parent: int,
) -> None:
    """The sampler process (no torch: see the module's docstring)."""
    signal_on_parent_death(signal.SIGKILL)  # a SIGKILLed learner must not leave it behind
    if os.getppid() != parent:  # the learner died before that took effect
        os._exit(1)
    samples.cancel_join_thread()  # may exit with batches nobody will take
    try:
        sampler = spec.replay(seed=spec.seed)
        writer = spec.replay()
        thread = threading.Thread(target=_write_priorities, args=(writer, priorities), daemon=True)
        thread.start()
        while not halt.is_set():
            if sampler.size() < spec.learning_starts:
                time.sleep(0.05)
                continue
            s = sampler.sample(spec.batch_size, spec.beta)
            while s is not None and not halt.is_set():
                try:
                    samples.put(s, timeout=0.1)
                    break
                except queue.Full:
                    continue
        thread.join(10)
    except Exception as e:
        log.exception("sampler failed")
        with contextlib.suppress(Exception):
            samples.put(f"{type(e).__name__}: {e}", timeout=1)
        raise


def _write_priorities(writer: ShardedReplay, priorities: Any) -> None:
    """Send priority updates until ``None``, merging whatever queued up into one ZADD XX."""
    done = False
    while not done:
        items = [priorities.get()]
        while True:
            try:
                items.append(priorities.get_nowait())
            except queue.Empty:
                break
        done = items[-1] is None
        batches = [i for i in items if i is not None]
        if not batches:
            continue
        try:
            writer.update_priorities(
                [m for ids, _ in batches for m in ids], np.concatenate([p for _, p in batches])
            )
        except redis.RedisError:
            log.exception("priority update failed")
