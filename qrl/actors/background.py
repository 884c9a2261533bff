"""Redis round trips off the acting path: an actor far from Redis (1-20 ms away) would
otherwise stop acting for every push and every weights fetch. :class:`Background` runs one
job at a time on a thread of its own while the actor acts on (the next unit overlaps the
push of the last, as SEED's actors keep env batches in flight); a job still running when
the next one comes is waited for first, so at most one unit is in flight and a full stream
still holds the actor back.

In a one-process run (a seated clock, :mod:`qrl.wire.clock`) a job runs at once in the
caller: threads of their own would make the turns, and so the run, depend on timing."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from qrl.wire import clock


class Background:
    """Jobs (callables returning whether they could go on) run one at a time, off the
    caller's thread in real time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future[bool] | None = None

    def submit(self, job: Callable[[], bool]) -> bool:
        """Wait for the job before (raising what it raised), then start ``job``; False, and
        ``job`` not started, if the one before returned False (stopped while waiting)."""
        if not self.wait():
            return False
        if clock.current() is not clock.REAL:
            return job()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        self._last = self._pool.submit(job)
        return True

    def wait(self) -> bool:
        """Wait for the job running, if any; what it returned (True if none ran)."""
        last, self._last = self._last, None
        return True if last is None else last.result()

    def close(self) -> bool:
        """Wait for the job running and stop the thread; what the job returned."""
        try:
            return self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
