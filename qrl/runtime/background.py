"""Redis round trips off a role's main path: an actor far from Redis (1-20 ms away) would
otherwise stop acting for every push and every weights fetch, a learner stop training for
every publication. :class:`Background` runs one job at a time on a thread of its own while
the role goes on (the next unit overlaps the push of the last, as SEED's actors keep env
batches in flight); a job still running when the next one comes is waited for first, so at
most one is in flight and a full stream still holds an actor back.

In a one-process run (a seated clock, :mod:`qrl.wire.clock`) a job runs at once in the
caller: threads of their own would make the turns, and so the run, depend on timing."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from qrl.wire import clock


class Background:
    """Jobs run one at a time, off the caller's thread in real time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future[Any] | None = None

    @property
    def in_line(self) -> bool:
        """Whether jobs run in the caller (a one-process run's seated clock)."""
        return clock.current() is not clock.REAL

    def submit(self, job: Callable[[], Any]) -> Any:
        """Wait for the job before and start ``job``; the newest result known: what the job
        before returned (raised: raised here; ``None`` if there was none), or in line what
        ``job`` returned."""
        before = self.wait()
        if self.in_line:
            return job()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        self._last = self._pool.submit(job)
        return before

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
