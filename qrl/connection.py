"""Connecting to Redis from a URL, with retry and backoff on connection loss."""

from __future__ import annotations

import logging
import os
import time
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

log = logging.getLogger(__name__)

ENV_URL = "QRL_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


class RedisUnavailable(RuntimeError):
    """Redis could not be reached (the message names the URL, without its password)."""


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
    retries: int = 6,
    socket_timeout: float | None = 30.0,
) -> redis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://``; user and password in
    the URL), checked with PING.

    Commands that fail on a lost connection are retried with exponential backoff
    (``retries`` times, up to ~10 s between tries). If Redis does not answer, PING is tried
    again for up to ``wait`` seconds, then :class:`RedisUnavailable` is raised with a clear
    message.
    """
    url = url or default_url()
    try:
        client = redis.Redis.from_url(
            url,
            retry=Retry(ExponentialBackoff(cap=10.0, base=0.05), retries),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            socket_timeout=socket_timeout,
            socket_connect_timeout=5.0,
            health_check_interval=30,
        )
    except ValueError as e:
        raise RedisUnavailable(f"bad Redis URL {redact(url)!r}: {e}") from e
    deadline = time.monotonic() + wait
    delay = 0.1
    while True:
        try:
            client.ping()
            return client
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            if time.monotonic() + delay > deadline:
                raise RedisUnavailable(
                    f"cannot reach Redis at {redact(url)}: {e}. Start one with `qrl redis`, "
                    f"pass --redis URL, or set {ENV_URL}."
                ) from e
            log.warning("Redis at %s not answering (%s); retrying in %.1fs", redact(url), e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
