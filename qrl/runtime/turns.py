"""One-process runs (``qrl train --one-process``): every role of a run, and the helpers a
role starts (a learner's samplers or loader), as threads of one process that take turns in
a fixed order, one thread at a time.

A :class:`Table` seats threads, each at a :class:`Seat`. The thread whose turn it is runs;
every other waits for its turn. A seat hands the turn to the next one (in seating order,
round and round) when its role finished a step (:meth:`Seat.turn`, called by the role
loop) and whenever it would wait for another part of the run: a seat is its thread's clock
(:mod:`qrl.wire.clock`), and its :meth:`~Seat.sleep` and :meth:`~Seat.poll` hand the turn
over instead of waiting. A role whose step would block thus gives the others their turns
and takes its step up again at its next turn. The clock's time is the number of rounds
(:data:`TICK` seconds each), so what a role decides on time (a producer's patience, PPO's
pacing, how long a stream read waits) depends on turns, not on the machine.

Nothing runs beside the seat whose turn it is, so the order of every Redis command, every
draw of a random generator and every torch op follows from the seating and the seed: two
runs of a seed compute the same weights (tests/test_one_process.py). Threads without a
seat only keep time for others (a lease's heartbeat) and change nothing a role computes.

Why a turn handed over inside a wait rather than a step that returns: the waits sit deep in
the parts the roles share (a producer waiting for room, the actors' rate limit, a sampler
waiting for the replay to fill, a feed waiting for a batch). A wait that returned would
need each of them rewritten as a state machine to resume, a second shape of every part;
handing the turn over needs only that the waits read this clock, and the roles run as
they do in processes, the same code.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from qrl.wire import clock
from qrl.wire.clock import Clock

log = logging.getLogger(__name__)

TICK = 0.001  # the seconds of a one-process run's clock that one round of turns counts for


class Seat(Clock):
    """A thread's place at a :class:`Table`, its clock, and the handle others hold on it
    (what ``qrl train`` and a feed ask of a process: ``start``, ``is_alive``, ``exitcode``,
    ``join``, ``terminate``)."""

    pid = None  # no process of its own

    def __init__(
        self, table: Table, name: str, target: Callable[[], int | None] | None, parent: Seat | None
    ) -> None:
        self.table, self.name, self.parent = table, name, parent
        self._target = target
        self._go = threading.Lock()  # released by the seat before it: this seat's turn
        self._go.acquire()
        self.thread: threading.Thread | None = None
        self.exitcode: int | None = None

    # -- the clock of its thread
    def now(self) -> float:
        return self.table.rounds * TICK

    def sleep(self, seconds: float) -> None:
        self.turn()

    def poll(self, ready: Callable[[float], bool], end: float) -> bool:
        while not ready(0.0):
            if self.now() >= end:
                return False
            self.turn()
        return True

    def turn(self) -> None:
        self.table._pass(self)

    def helpers(self) -> Any:
        return Helpers(self)

    # -- the handle
    def start(self) -> None:
        """Seat the thread (after its parent's seat and the seats started from it before) and
        start it; it runs at its first turn."""
        assert self._target is not None and self.thread is None
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.table._seat(self)
        self.thread.start()

    def _run(self) -> None:
        self._go.acquire()
        clock.use(self)
        code = 1
        try:
            code = self._target() or 0  # type: ignore[misc]
        except BaseException:
            log.exception("%s failed", self.name)
        finally:
            self.exitcode = code
            self.table._leave(self)

    def is_alive(self) -> bool:
        return self.thread is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait until the seat's thread ended, at most ``timeout`` seconds (real time); a
        seated caller hands its turns on meanwhile."""
        me = clock.current()
        if not isinstance(me, Seat) or me.table is not self.table:
            if self.thread is not None:
                self.thread.join(timeout)
            return
        end = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (end is None or time.monotonic() < end):
            me.turn()

    def terminate(self) -> None:
        """A thread cannot be ended from outside: it ends at its next stop check."""
        log.warning("%s did not stop: a thread of this process cannot be ended", self.name)

    kill = terminate


class Helpers:
    """A role's helpers in a one-process run, as a ``multiprocessing`` context: ``Process``
    is a seat right after the role's; the rest (pipes, locks, events, shared memory: all
    in this process) is ``fork``'s, whose locks need no resource-tracker process."""

    def __init__(self, seat: Seat) -> None:
        self._seat = seat
        self._ctx = multiprocessing.get_context("fork")

    def Process(  # noqa: N802  (multiprocessing's name)
        self, target: Callable[..., None], args: tuple = (), name: str = "helper", **_: Any
    ) -> Seat:
        return Seat(self._seat.table, name, partial(target, *args), self._seat)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


class Table:
    """The seats of one one-process run, taking turns in seating order."""

    def __init__(self) -> None:
        self.seats: list[Seat] = []
        self.rounds = 0  # rounds of turns so far: the clock's time

    @contextmanager
    def sit(self, name: str) -> Iterator[Seat]:
        """Seat the calling thread first, holding the turn (it starts the others), for the
        ``with`` block; its clock is real again after it. Seats still running then (roles that
        did not stop) stay where they are, waiting for a turn that does not come."""
        assert not self.seats, "the table has a first seat"
        seat = Seat(self, name, None, None)
        seat.thread = threading.current_thread()
        self.seats.append(seat)
        token = clock.use(seat)
        try:
            yield seat
        finally:
            clock.restore(token)
            left = [s.name for s in self.seats if s is not seat]
            if left:
                log.warning("left at the table, not stopped: %s", ", ".join(left))

    def start(self, name: str, target: Callable[[], int | None]) -> Seat:
        """Run ``target()`` (its return value: the exit code) in a thread seated after the
        caller's seat; the caller must hold the turn."""
        seat = Seat(self, name, target, self._holder())
        seat.start()
        return seat

    def seat_of(self, thread: int | None) -> Seat | None:
        """The seat of the thread of ident ``thread``, if it has one."""
        return next((s for s in self.seats if s.thread and s.thread.ident == thread), None)

    def _holder(self) -> Seat:
        me = clock.current()
        assert isinstance(me, Seat) and me.table is self, "only a seated thread starts seats"
        return me

    def _seat(self, seat: Seat) -> None:
        """Place ``seat`` after its parent and the seats started from the parent before."""
        i = self.seats.index(seat.parent) if seat.parent is not None else len(self.seats) - 1
        while i + 1 < len(self.seats) and self._descends(self.seats[i + 1], seat.parent):
            i += 1
        self.seats.insert(i + 1, seat)

    @staticmethod
    def _descends(seat: Seat | None, parent: Seat | None) -> bool:
        """Whether ``seat`` was started from ``parent``, or from a seat started from it."""
        while seat is not None:
            seat = seat.parent
            if seat is parent:
                return True
        return False

    def _next(self, i: int) -> Seat:
        """The seat after index ``i`` (a new round after the last)."""
        if i + 1 >= len(self.seats):
            self.rounds += 1
            return self.seats[0]
        return self.seats[i + 1]

    def _pass(self, seat: Seat) -> None:
        """``seat``, holding the turn, hands it to the next seat and waits for its next turn."""
        nxt = self._next(self.seats.index(seat))
        if nxt is not seat:
            nxt._go.release()
            seat._go.acquire()

    def _leave(self, seat: Seat) -> None:
        """``seat``'s thread ends (holding the turn): the next seat's turn."""
        i = self.seats.index(seat)
        self.seats.pop(i)
        if self.seats:
            self._next(i - 1)._go.release()
