"""Run control through Redis: a ``stop`` flag every role of a run polls."""

from __future__ import annotations

import signal
import threading
import time

import redis

from qrl.keys import RunKeys


class StopFlag:
    """True once the run's ``stop`` flag is set in Redis or this process got SIGINT/SIGTERM.
    Redis is asked at most every ``interval`` seconds."""

    def __init__(
        self, client: redis.Redis, keys: RunKeys, interval: float = 0.5, signals: bool = True
    ) -> None:
        self.client, self.keys, self.interval = client, keys, interval
        self.local = threading.Event()
        self._next = 0.0
        if signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self.local.set())

    def __call__(self) -> bool:
        if self.local.is_set():
            return True
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval
            if self.client.hget(self.keys.control, "stop"):
                self.local.set()
        return self.local.is_set()


def request_stop(client: redis.Redis, keys: RunKeys) -> None:
    """Ask every role of the run to stop."""
    client.hset(keys.control, "stop", 1)
