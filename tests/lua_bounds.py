"""What the bounded-work tests of qrl's Lua scripts share (tests/test_lua_bounded.py: the
replay's scripts; tests/test_lua_scripts.py: streams, leases, weights, live config): a
private redis-server per module, hostile stored values, and :func:`bounded`, which fails
when one command of a call holds the server for :data:`LIMIT` or the call never returns."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys

LIMIT = 1.0  # seconds one command may hold the server (the unbounded loops take seconds to forever)
TIMEOUT = 10.0  # seconds a call may take in all, on a loaded machine
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
    """``call(client)``'s result or the Redis error it raised; fails unless no command of it
    held the server for :data:`LIMIT` (by Redis's own SLOWLOG, so a loaded machine's slow
    client does not count) and it returned within :data:`TIMEOUT` (a script that never ends
    leaves no SLOWLOG entry)."""
    admin = private.client(timeout=TIMEOUT)
    admin.config_set("slowlog-log-slower-than", int(LIMIT * 1e6))
    admin.slowlog_reset()
    client = private.client(timeout=TIMEOUT)
    try:
        out = call(client)
    except (redis.TimeoutError, redis.ConnectionError) as e:
        out = e
    except redis.ResponseError as e:  # a clean error, not counted as wedging
        out = e
    hung = isinstance(out, (redis.TimeoutError, redis.ConnectionError))
    held = [] if hung else [e["duration"] / 1e6 for e in admin.slowlog_get(16)]
    client.close()
    admin.close()
    if hung or held:
        private.restart()
    assert not hung, f"the call did not return within {TIMEOUT:.0f}s ({out!r})"
    assert not held, f"commands held the server for {held} s"
    return out


WRONG_TYPES: dict[str, Callable[[redis.Redis, str], Any]] = {
    "string": lambda c, k: c.set(k, "x"),
    "list": lambda c, k: c.rpush(k, "x"),
    "hash": lambda c, k: c.hset(k, "x", "1"),
    "zset": lambda c, k: c.zadd(k, {"x": 1}),
}
