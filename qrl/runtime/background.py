"""Redis round trips off a role's main path: an actor far from Redis (1-20 ms away) would
otherwise stop acting for every push and every weights fetch, a learner stop training for
every publication. :class:`Background` runs one job at a time on a thread of its own while
the role goes on (the next unit overlaps the push of the last, as SEED's actors keep env
batches in flight); a job still running when the next one comes is waited for first, so at
most one is in flight and a full stream still holds an actor back.

Only where the round trips are long: while the median of its last :data:`RECENT` jobs took
under :data:`FAR_S` (Redis on this machine or next to it) a job runs at once in the caller.
The median, not the mean: on a busy 2-core machine a loopback round trip now and then takes
10 ms (an ES worker's looks went off its path there on a running mean), where a far link
makes most of them slow, and so does a job that is slow on any link (a sampler's priority
write-back, which overlaps the next draw near Redis too).
Near Redis a second thread buys nothing and costs freshness (an unroll actor on loopback acted
with weights a unit older, and its CartPole runs took 1.18x as long to solve:
notes/benchmarks-notebook.md, "Roles of parts, round trips off the main paths"). In a
one-process run (a seated clock, :mod:`qrl.wire.clock`) every job runs in the caller: threads
of their own would make the turns, and so the run, depend on timing."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from qrl.wire import clock

FAR_S = 0.001  # jobs mostly slower than this (a round trip of 1 ms or more) go off it
RECENT = 8  # the jobs whose median says how far Redis is


class Background:
    """Jobs run one at a time: in the caller while most of the last few were quick, else
    on a thread of their own (in real time)."""

    def __init__(self, name: str, far_s: float = FAR_S) -> None:
        self.name, self.far_s = name, far_s
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future[Any] | None = None
        self.times: deque[float] = deque(maxlen=RECENT)  # the last jobs' seconds
        self.ran_in_line = True  # how the last job submitted ran

    @property
    def took(self) -> float:
        """The median of the seconds the last :data:`RECENT` jobs took (0 before any)."""
        return statistics.median(self.times) if self.times else 0.0

    @property
    def in_line(self) -> bool:
        """Whether the next job runs in the caller (once the one under way is done: a
        caller that waited for it with :meth:`wait` knows how the next will run)."""
        return clock.current() is not clock.REAL or self.took < self.far_s

    def submit(self, job: Callable[[], Any]) -> Any:
        """Wait for the job before and start ``job``; the newest result known: what the job
        before returned (raised: raised here; ``None`` if there was none), or, if ``job``
        ran in line (:attr:`ran_in_line`), what it returned."""
        before = self.wait()
        self.ran_in_line = self.in_line
        if self.ran_in_line:
            return self._timed(job)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        self._last = self._pool.submit(self._timed, job)
        return before

    def _timed(self, job: Callable[[], Any]) -> Any:
        t0 = time.monotonic()  # (a one-process run's choice never reads it)
        try:
            return job()
        finally:
            self.times.append(time.monotonic() - t0)

    @property
    def busy(self) -> bool:
        """Whether a job is under way on the thread (a caller may go on without another)."""
        return self._last is not None and not self._last.done()

    def wait(self) -> Any:
        """Wait for the job under way, if any; what the last job returned (``None`` if it
        was taken already)."""
        last, self._last = self._last, None
        return None if last is None else last.result()

    def close(self) -> Any:
        """Wait for the job under way and stop the thread; what the last job returned."""
        try:
            return self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
