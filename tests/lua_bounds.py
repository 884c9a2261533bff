"""What the bounded-work tests of qrl's Lua scripts share (tests/test_lua_bounded.py: the
replay's scripts; tests/test_lua_scripts.py: streams, leases, weights, live config): a
private redis-server per module, hostile stored values, and :func:`bounded`, which fails
unless a call returns within :data:`LIMIT` while another client's PINGs answer."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys

LIMIT = 1.0  # seconds a call may take (the unbounded loops take seconds to forever)
PING_LIMIT = LIMIT  # seconds another client's PING may wait meanwhile (a noisy machine)
CAP = 100
HOSTILE = [
    "4000000",
    "9000000",
    "1000000000000000",
    "9007199254740993",
    "99999999999999999999999",
    "9223372036854775807",
    "-1",
    "-4000000",
    "-1000000000000000",
    "-9223372036854775808",
    "4e6",
    "-4e6",
    "1e308",
    "inf",
    "-inf",
    "nan",
    "1.5",
    "0x10",
    " 7",
    "",
    "abc",
    "x" * 1000,
]
_runs = itertools.count()


class Private:
    """A private redis-server that can be killed and restarted when a script wedges it."""

    def __init__(self) -> None:
        self.server = EmbeddedRedis().start()

    def client(self, timeout: float | None = None) -> redis.Redis:
        # no retries: a timed-out script call must not be sent again once the server is free
        return redis.Redis(
            host=self.server.host,
            port=self.server.port,
            socket_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def restart(self) -> None:
        if self.server.proc is not None:
            self.server.proc.kill()  # busy in a script: SIGTERM would wait for it
        self.server.stop()
        self.server = EmbeddedRedis().start()


@pytest.fixture(scope="module", name="private")
def private_server():
    """A redis-server of the test module's own (import this fixture into it)."""
    p = Private()
    yield p
    p.server.stop()


@pytest.fixture(name="r")
def private_client(private) -> redis.Redis:
    """A client of the private server (shadows conftest's ``r``)."""
    client = private.client()
    yield client
    client.close()


def fresh_keys() -> RunKeys:
    return RunKeys(f"b{next(_runs)}")


def bounded(private: Private, call: Callable[[redis.Redis], Any]) -> Any:
    """``call(client)``'s result or the Redis error it raised; fails unless it came within
    :data:`LIMIT` while PINGs from another client answered within :data:`PING_LIMIT`."""
    client = private.client(timeout=LIMIT)
    pinger = private.client(timeout=PING_LIMIT)
    pinger.ping()
    pings: list[Any] = []
    stop = threading.Event()

    def ping() -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                pinger.ping()
                pings.append(time.monotonic() - t)
            except redis.RedisError as e:
                pings.append(e)
            stop.wait(0.02)

    thread = threading.Thread(target=ping, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        out = call(client)
    except (redis.TimeoutError, redis.ConnectionError) as e:
        out = e
    except redis.ResponseError as e:  # a clean error, not counted as wedging
        out = e
    elapsed = time.monotonic() - start
    stop.set()
    thread.join()
    slow = [p for p in pings if not isinstance(p, float) or p > PING_LIMIT]
    wedged = elapsed > LIMIT or isinstance(out, (redis.TimeoutError, redis.ConnectionError))
    client.close()
    pinger.close()
    if wedged or slow:
        private.restart()
    assert not wedged, f"the call took {elapsed:.2f}s ({out!r})"
    assert not slow, f"another client's PING: {slow[:3]}"
    return out


WRONG_TYPES: dict[str, Callable[[redis.Redis, str], Any]] = {
    "string": lambda c, k: c.set(k, "x"),
    "list": lambda c, k: c.rpush(k, "x"),
    "hash": lambda c, k: c.hset(k, "x", "1"),
    "zset": lambda c, k: c.zadd(k, {"x": 1}),
}
