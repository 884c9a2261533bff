"""The processes that fill a learner's ring (:mod:`qrl.replay.ring`): the replay's samplers
(:mod:`qrl.replay.sampler`) and the unroll learners' loader (:mod:`qrl.learners.loader`).

:class:`Feed` is the learner's side: it starts them (``spawn``: fresh interpreters, not
forks of a learner with live torch threads and Redis pools; in a one-process run, threads
seated after the learner's: :meth:`qrl.wire.clock.Clock.helpers`), takes what they hand over,
turns a process that died or gave up into a ``RuntimeError`` that names it, and stops them.
:func:`feeding` is a process's side: it dies with a SIGKILLed learner, runs as a batch
process (below) and, if it fails, tells the learner why before it exits.

A feed process wakes a few times per update (a slot given back, a Redis reply, the end of
a nap). At the normal policy each wake-up may preempt the learner on its CPU when the
machine has no idle one; on 2 cores the learner lost ~3.5% of its time waiting to run
again that way (notes/benchmarks-notebook.md, "Feed processes that do not preempt the
learner").
``SCHED_BATCH`` (Linux) keeps its share of the CPU and its niceness but never preempts on
waking: it runs on an idle CPU, or when the running task's slice ends.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from qrl.replay.ring import SlotRing
from qrl.server.embedded import signal_on_parent_death

log = logging.getLogger(__name__)


class Feed:
    """``len(args)`` processes filling ``ring`` (made with ``ctx``), process ``k`` running
    ``target(*args[k], ring, halt, learner pid)`` and named ``names[k]`` (its messages and
    errors say that name)."""

    def __init__(
        self,
        ctx: Any,
        ring: SlotRing,
        target: Callable[..., None],
        args: list[tuple],
        names: list[str],
    ) -> None:
        self.ring = ring
        self._halt = ctx.Event()
        self._procs = [
            ctx.Process(
                target=target, args=(*a, ring, self._halt, os.getpid()), name=n, daemon=True
            )
            for a, n in zip(args, names, strict=True)
        ]
        for p in self._procs:
            p.start()
        self._checked = 0.0  # when the processes were last seen alive

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def get(self, timeout: float) -> Any | None:
        """The ring's next item (:meth:`SlotRing.get`), ``None`` if none came within
        ``timeout``; raises ``RuntimeError`` if a process died or failed."""
        now = time.monotonic()
        if now > self._checked + 1.0:  # (a syscall each: not on every update)
            self._check(now)
        item = self.ring.get(timeout)
        if item is None:
            self._check(time.monotonic())  # none came: a process may have died
        if isinstance(item, str):  # a process's last words
            raise RuntimeError(item)
        return item

    def _check(self, now: float) -> None:
        self._checked = now
        for p in self._procs:
            if not p.is_alive():
                raise RuntimeError(f"{p.name} (exit code {p.exitcode})")

    def stop(self) -> None:
        """Ask the processes to finish (each does what it owes the run: priorities written,
        entries acknowledged), then end them; after 10 s they are terminated."""
        self._halt.set()
        deadline = time.monotonic() + 10
        for p in self._procs:
            while p.is_alive() and time.monotonic() < deadline:
                self.ring.get(0.05)  # a process waiting to hand a batch over can stop
            if p.is_alive():
                p.terminate()


def batch_policy(name: str) -> None:
    """This process runs as ``SCHED_BATCH`` (see the module's docstring), where the OS has
    it; any process may take it (it raises no priority)."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as e:  # e.g. a sandbox that forbids the call: it runs as before
        log.warning("%s: could not set SCHED_BATCH: %s", name, e)


@contextlib.contextmanager
def feeding(ring: SlotRing, parent: int, nice: int = 0) -> Iterator[None]:
    """A feed process's body runs inside: a SIGKILLed learner (pid ``parent``) takes the
    process with it, it runs as a batch process (``nice`` steps nicer than the learner), and
    an exception is logged and sent to the learner as last words. A feed in the learner's
    own process (a thread of a one-process run, :mod:`qrl.runtime.turns`) leaves the
    process's settings alone."""
    if os.getpid() == parent:
        name = threading.current_thread().name
    else:
        signal_on_parent_death(signal.SIGKILL)  # a SIGKILLed learner must not leave it behind
        if os.getppid() != parent:  # the learner died before that took effect
            os._exit(1)
        name = multiprocessing.current_process().name
        batch_policy(name)
        if nice:
            os.nice(nice)
    try:
        yield
    except Exception as e:
        log.exception("%s failed", name)
        with contextlib.suppress(Exception):
            ring.last_words(f"{name}: {type(e).__name__}: {e}")
        raise
