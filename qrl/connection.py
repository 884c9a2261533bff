"""Connecting to Redis from a URL, with retry and backoff on connection loss."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import AbstractBackoff, ExponentialBackoff
from redis.exceptions import AuthenticationError, NoPermissionError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

log = logging.getLogger(__name__)

ENV_URL = "QRL_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


ENV_DEADLINE = "QRL_REDIS_DEADLINE"
DEFAULT_DEADLINE = 60.0


class RedisUnavailable(RuntimeError):
    """Redis could not be reached (the message names the URL, without its password)."""


def redis_deadline() -> float:
    """Seconds a role keeps retrying a lost Redis before giving up (``QRL_REDIS_DEADLINE``,
    default 60)."""
    raw = os.environ.get(ENV_DEADLINE)
    try:
        return float(raw) if raw else DEFAULT_DEADLINE
    except ValueError:
        log.warning("ignoring %s=%r (not a number)", ENV_DEADLINE, raw)
        return DEFAULT_DEADLINE


# Redis URL -> when this process saw it go: one outage logs one line per process, however
# many clients, threads and commands wait on it
_outages: dict[str, float] = {}
_outage_lock = threading.Lock()
os.register_at_fork(after_in_child=_outages.clear)


class DeadlineBackoff(AbstractBackoff):
    """redis-py's retry policy (``Retry(DeadlineBackoff(...), -1)``) with a deadline:
    exponential backoff up to 2 s apart while a command keeps failing, until ``deadline``
    seconds have passed since its first failure; then :class:`RedisUnavailable`. One outage
    logs one warning when it starts and one line when Redis is back, per process. A wrong
    password is raised at once: it does not get better by waiting.

    redis-py copies the retry policy into every connection; the copies share this object
    (``__deepcopy__``), so a deadline set after the first PING holds for all of them. The
    time of the first failure is kept per thread: a call's retries run in one thread."""

    def __init__(self, url: str, deadline: float) -> None:
        self.url, self.deadline = redact(url), deadline
        self._exp = ExponentialBackoff(cap=2.0, base=0.05)
        self._local = threading.local()

    def reset(self) -> None:
        """Called before every command (and before each connection attempt inside one).
        Once this thread's outage saw two of these with no failure between, its last command
        went through (past the deadline it would have raised): Redis is back."""
        if getattr(self._local, "since", None) is None:
            return
        if not getattr(self._local, "armed", False):
            self._local.armed = True
            return
        self._local.since = self._local.armed = None
        with _outage_lock:
            since = _outages.pop(self.url, None)
        if since is not None:
            log.warning(
                "Redis at %s is back after %.1fs; carrying on", self.url, time.monotonic() - since
            )

    def compute(self, failures: int) -> float:
        error = sys.exc_info()[1]  # the failure being retried (we run in redis-py's except)
        if isinstance(error, AuthenticationError):
            raise error
        now = time.monotonic()
        self._local.armed = False
        if failures == 1 or getattr(self._local, "since", None) is None:
            self._local.since = now
            with _outage_lock:
                if self.url not in _outages:
                    _outages[self.url] = now
                    log.warning(
                        "Redis at %s not answering (%s); retrying with backoff for up to %.0fs",
                        self.url,
                        error,
                        self.deadline,
                    )
        if now - self._local.since > self.deadline:
            self._local.since = None
            raise RedisUnavailable(
                f"Redis at {self.url} has not answered for {self.deadline:.0f}s "
                f"({error}); giving up (set {ENV_DEADLINE} to wait longer)"
            ) from error
        return self._exp.compute(failures)

    def __deepcopy__(self, memo: dict) -> DeadlineBackoff:
        return self


def failure_exit(error: BaseException) -> tuple[int, str] | None:
    """The exit code and one-line message for a Redis failure that ends a command: Redis
    gone past its deadline (3), an ACL refusal (1); ``None`` for anything else."""
    if isinstance(error, RedisUnavailable):
        return 3, f"Error: {error}"
    if isinstance(error, NoPermissionError):
        return 1, f"Error: Redis refused: NOPERM {error} (check the user's ACL rules)"
    return None


def default_url() -> str:
    """The Redis URL from ``QRL_REDIS_URL``, else ``redis://127.0.0.1:6379/0``."""
    return os.environ.get(ENV_URL) or DEFAULT_URL


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def connect(
    url: str | None = None,
    *,
    wait: float = 0.0,
    deadline: float | None = None,
    socket_timeout: float | None = 30.0,
) -> redis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://``; user and password in
    the URL), checked with PING.

    Commands that fail on a lost connection are retried with exponential backoff (up to 2 s
    apart) for up to ``deadline`` seconds (default :func:`redis_deadline`), then raise
    :class:`RedisUnavailable`. If Redis does not answer at first, PING is tried again for up
    to ``wait`` seconds, then :class:`RedisUnavailable` is raised with a clear message.
    """
    url = url or default_url()
    backoff = DeadlineBackoff(url, wait)  # the first PING waits at most ``wait``
    try:
        client = redis.Redis.from_url(
            url,
            retry=Retry(backoff, -1, (RedisConnectionError, RedisTimeoutError, OSError)),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            socket_timeout=socket_timeout,
            socket_connect_timeout=5.0,
            health_check_interval=30,
        )
    except ValueError as e:
        raise RedisUnavailable(f"bad Redis URL {redact(url)!r}: {e}") from e
    try:
        client.ping()
    except (RedisUnavailable, RedisConnectionError, RedisTimeoutError, OSError) as e:
        cause = e.__cause__ or e
        raise RedisUnavailable(
            f"cannot reach Redis at {redact(url)}: {cause}. Start one with `qrl redis`, "
            f"pass --redis URL, or set {ENV_URL}."
        ) from e
    backoff.deadline = redis_deadline() if deadline is None else deadline
    return client
