"""Connecting to Redis from a URL, with retry and backoff on connection loss."""

from __future__ import annotations

import logging
import os
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError
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


class DeadlineRetry(Retry):
    """Retry a command on a lost connection with exponential backoff for up to ``deadline``
    seconds, then raise :class:`RedisUnavailable`. One outage logs one warning when it starts
    and one line when Redis is back, per process."""

    def __init__(self, url: str, deadline: float) -> None:
        super().__init__(
            ExponentialBackoff(cap=2.0, base=0.05),
            -1,
            (RedisConnectionError, RedisTimeoutError, OSError),
        )
        self.url, self.deadline = redact(url), deadline

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # noqa: ANN001
        start, failures = time.monotonic(), 0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if isinstance(error, AuthenticationError) or (
                    is_retryable and not is_retryable(error)
                ):
                    raise  # a wrong password does not get better by waiting
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                with _outage_lock:
                    if self.url not in _outages:
                        _outages[self.url] = start
                        log.warning(
                            "Redis at %s not answering (%s); retrying with backoff for up to %.0fs",
                            self.url,
                            error,
                            self.deadline,
                        )
                if time.monotonic() - start > self.deadline:
                    raise RedisUnavailable(
                        f"Redis at {self.url} has not answered for {self.deadline:.0f}s "
                        f"({error}); giving up (set {ENV_DEADLINE} to wait longer)"
                    ) from error
                time.sleep(self._backoff.compute(failures))
                continue
            if _outages:
                with _outage_lock:
                    since = _outages.pop(self.url, None)
                if since is not None:
                    log.warning(
                        "Redis at %s is back after %.1fs; carrying on",
                        self.url,
                        time.monotonic() - since,
                    )
            return result

    def __deepcopy__(self, memo: dict) -> DeadlineRetry:
        return self  # redis-py copies the retry into every connection: share one outage state

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


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
    retry = DeadlineRetry(url, wait)  # the first PING waits at most ``wait``
    try:
        client = redis.Redis.from_url(
            url,
            retry=retry,
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
    retry.deadline = redis_deadline() if deadline is None else deadline
    return client
