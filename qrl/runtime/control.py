"""Stopping: the run's ``stop`` flag in Redis, and SIGINT/SIGTERM to this process."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis

from qrl.wire.connection import stop_waiting
from qrl.wire.faults import repaired
from qrl.wire.keys import RunKeys

if TYPE_CHECKING:
    from qrl.runtime.live import LiveConfig


def on_stop_signals(handler: Callable[[], None]) -> None:
    """Call ``handler`` on SIGINT and SIGTERM: the one place qrl installs signal handlers
    (main thread only). From the signal on, a lost Redis is not waited for
    (:func:`~qrl.wire.connection.stop_waiting`): a process asked to stop while Redis is away
    finishes what it can and ends, instead of retrying each command until the deadline."""

    def on_signal(*_: object) -> None:
        stop_waiting()
        handler()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


class StopFlag:
    """True once the run's ``stop`` flag is set in Redis or ``local`` is set (by a signal,
    with ``signals``, or by the caller). Redis is asked at most every ``interval`` seconds;
    with ``live``, the same round trip reads the run's live config version (a role takes
    changes in between steps without a round trip of their own)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        interval: float = 0.5,
        signals: bool = True,
        local: threading.Event | None = None,
        live: LiveConfig | None = None,
    ) -> None:
        self.client, self.keys, self.interval, self.live = client, keys, interval, live
        self.local = local or threading.Event()
        self._next = 0.0
        if signals and threading.current_thread() is threading.main_thread():
            on_stop_signals(self.local.set)

    def __call__(self) -> bool:
        if self.local.is_set():
            return True
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval
            if self._asked():
                self.local.set()
        return self.local.is_set()

    def _asked(self) -> bool:
        stop = self.live.poll() if self.live is not None else None
        if stop is not None:
            return stop
        key = self.keys.control  # (of another type: repaired here)
        return bool(repaired(self.client, key, lambda: self.client.hget(key, "stop"), None))


def request_stop(client: redis.Redis, keys: RunKeys) -> None:
    """Ask every role of the run to stop."""
    repaired(client, keys.control, lambda: client.hset(keys.control, "stop", 1), None)


def clear_stop(client: redis.Redis, keys: RunKeys) -> None:
    """Take a stop request back (a rerun of a stopped run starts afresh)."""
    repaired(client, keys.control, lambda: client.hdel(keys.control, "stop"), 0)
