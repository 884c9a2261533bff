"""The time that qrl's waits read, and how they wait.

Code that waits for another part of a run (room in a stream, a batch, the first weights, the
learner to catch up, a stream entry) sleeps and reads the time through this module, not
:mod:`time`. A process of a run (the usual case) runs on :data:`REAL` time. A thread of a
one-process run (``qrl train --one-process``: :mod:`qrl.runtime.turns`) runs on the clock of
its seat: there a wait hands the turn to the next role instead of sleeping, and the time
counts rounds of turns, so decisions taken on time (a producer's patience, an actor's
pacing) come out the same in every run of a seed.

The clock is the calling thread's own (a context variable, default :data:`REAL`): a
one-process run seats each of its threads, and nothing else changes. Timers that only pace
reports (metrics, heartbeats, liveness checks) keep to :mod:`time`: they never change what
a run computes.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from multiprocessing.context import BaseContext


class Clock:
    """Real time: waits sleep, helpers are processes."""

    # seconds, monotonic; and a wait: :mod:`time`'s own functions, no call of Python's
    # between (a feed's ring reads the clock on every batch handed over)
    now: Callable[[], float] = staticmethod(time.monotonic)
    sleep: Callable[[float], None] = staticmethod(time.sleep)

    def poll(self, ready: Callable[[float], bool], end: float) -> bool:
        """Whether ``ready(timeout)``, which waits up to ``timeout`` seconds for something
        (a pipe to read), found it before ``end`` (a time of :meth:`now`)."""
        return ready(max(0.0, end - self.now()))

    def turn(self) -> None:
        """A role finished one step (:func:`qrl.runtime.loop.run_role`): nothing to do in
        real time; in turns, the next role's turn."""

    def helpers(self) -> BaseContext:
        """The ``multiprocessing`` context a role's helpers start in (a learner's samplers
        or loader, :mod:`qrl.replay.feed`): ``spawn``, fresh interpreters."""
        return multiprocessing.get_context("spawn")


REAL = Clock()
_clock: ContextVar[Clock] = ContextVar("qrl_clock", default=REAL)


def current() -> Clock:
    """The calling thread's clock."""
    return _clock.get()


def use(clock: Clock) -> Token[Clock]:
    """Run the calling thread on ``clock`` from now on (until :func:`restore`)."""
    return _clock.set(clock)


def restore(token: Token[Clock]) -> None:
    """The clock the calling thread ran on before the :func:`use` that gave ``token``."""
    _clock.reset(token)


def now() -> float:
    return _clock.get().now()


def sleep(seconds: float) -> None:
    _clock.get().sleep(seconds)
