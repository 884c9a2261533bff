"""Redis faults a role rides out or repairs instead of dying of: Redis out of memory or busy
running a script (waited out like a lost connection, see :func:`qrl.wire.connection.connect`,
or skipped for a write that can be lost), a Redis that lacks qrl's Lua scripts (waited out
until the admin loads them, :class:`ScriptsMissing`), a key of the wrong Redis type and a
stream whose ids someone used up (deleted and written afresh)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from redis.exceptions import NoPermissionError, NoScriptError, OutOfMemoryError, ResponseError
from redis.retry import Retry

log = logging.getLogger(__name__)

# what Redis answers a write while it is at ``maxmemory`` with ``noeviction``; Redis 6.2
# wraps it in a script's error ("Error running script ... -OOM command not allowed ...")
_OOM = "command not allowed when used memory"
_skip_oom = threading.local()  # set while a write that may be skipped runs (skip_if_full)
_await_scripts = threading.local()  # set while a script is run again after loading it


class ScriptsMissing(ResponseError):
    """NOSCRIPT once a script was loaded, or this user may not load it (a role's ACL user
    may run only qrl's scripts, :mod:`qrl.wire.scripts`): Redis restarted, failed over or
    flushed its scripts, and the admin loads them again. Waited out like a lost Redis."""

    def __str__(self) -> str:
        return "NOSCRIPT; its admin loads them with `qrl run scripts`"


@contextlib.contextmanager
def awaiting_scripts() -> Iterator[None]:
    """Run the block's commands waiting out a NOSCRIPT (:class:`ScriptsMissing`)."""
    _await_scripts.on = True
    try:
        yield
    finally:
        _await_scripts.on = False


# what Redis answers while a script runs past its time limit (redis-py has no class for it)
_BUSY = "BUSY "
# a command an ACL user lacks, as Redis says it inside a script (outside: NoPermissionError)
_SCRIPT_NOPERM = "can't run this command"


# distinct warnings remembered, and so logged, per kind: where ``what`` comes from data (the
# value names of hostile reports) a flood of new ones stops at the cap, neither flooding the
# log nor growing memory, and cannot silence the warnings of another kind
MAX_WARNED = 1000
_warned: dict[str, set[str]] = {}


def warn_once(
    what: str, message: str | None = None, *args: Any, kind: str = "", logger: Any = None
) -> None:
    """Log ``message`` (default: ``what``) the first time this process meets ``what``: a bad
    key or value that comes again with every call is logged once, not once a second. At most
    :data:`MAX_WARNED` distinct ones of each ``kind`` are, then one line saying no more will
    be."""
    seen, logger = _warned.setdefault(kind, set()), logger or log
    if what in seen or len(seen) > MAX_WARNED:
        return
    seen.add(what)
    if len(seen) > MAX_WARNED:
        logger.warning("%d distinct %s warnings logged: no more will be", MAX_WARNED, kind)
    else:
        logger.warning(what if message is None else message, *args)


_every: dict[str, tuple[float, int]] = {}  # what -> (when last logged, times unlogged)
EVERY_S = 60.0


def warn_every(what: str, message: str, *args: Any, logger: Any = None) -> None:
    """Log ``message`` the first time ``what`` happens, then at most once per
    :data:`EVERY_S` seconds with how often it happened since: a fault someone can repeat
    at will (a repaired key, a refused command) is seen, without flooding the log. ``what``
    comes from the code (a key, a role), never from data: what is remembered stays small."""
    now = time.monotonic()
    last, unlogged = _every.get(what, (-EVERY_S, 0))
    if now - last < EVERY_S:
        _every[what] = (last, unlogged + 1)
        return
    _every[what] = (now, 0)
    since = f" ({unlogged} more times in the last {now - last:.0f}s)" if unlogged else ""
    (logger or log).warning(message + since, *args)


def out_of_memory(error: BaseException) -> bool:
    return isinstance(error, ResponseError) and _OOM in str(error)


class BusyError(ResponseError):
    """Redis answered BUSY: a script runs past its time limit and every client waits (an
    outage, waited out like Redis out of memory)."""


def refused(error: BaseException) -> bool:
    """Whether ``error`` is an ACL refusal (NOPERM), in a script's error too."""
    return isinstance(error, NoPermissionError) or (
        isinstance(error, ResponseError) and _SCRIPT_NOPERM in str(error)
    )


class OutageRetry(Retry):
    """redis-py's ``Retry`` that also waits out Redis out of memory or busy, as it waits out
    a lost connection: an OOM refusal, in a script's error too, is raised as
    ``OutOfMemoryError`` and a BUSY reply as :class:`BusyError` (both retried), except
    an OOM inside :func:`skip_if_full`, which is not retried. Inside
    :func:`awaiting_scripts` a NOSCRIPT is waited out too."""

    def __init__(self, backoff: Any, retries: int, supported_errors: tuple) -> None:
        super().__init__(backoff, retries, (*supported_errors, ScriptsMissing))

    def call_with_retry(
        self,
        do: Callable[[], Any],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> Any:
        def attempt() -> Any:
            try:
                return do()
            except ResponseError as e:
                if out_of_memory(e) and not isinstance(e, OutOfMemoryError):
                    raise OutOfMemoryError(str(e)) from e
                if isinstance(e, NoScriptError) and getattr(_await_scripts, "on", False):
                    raise ScriptsMissing() from e
                if str(e).startswith(_BUSY) and not isinstance(e, BusyError):
                    raise BusyError(str(e)) from e
                raise

        def retryable(error: Exception) -> bool:
            if isinstance(error, OutOfMemoryError) and getattr(_skip_oom, "on", False):
                return False
            return is_retryable is None or is_retryable(error)

        return super().call_with_retry(attempt, fail, retryable, with_failure_count)


_skipped: set[str] = set()  # writes skipped since Redis last took them (logged once)


@contextlib.contextmanager
def skip_if_full(what: str) -> Iterator[None]:
    """Run the block's Redis commands without waiting for Redis out of memory: if it is, the
    block is left and ``what`` (a write that can be lost, e.g. a metrics report) skipped,
    with one warning until such a write goes through again."""
    _skip_oom.on = True
    try:
        yield
    except OutOfMemoryError as e:
        if what not in _skipped:
            _skipped.add(what)
            log.warning("Redis is out of memory (%s): %s skipped until it has room", e, what)
        return
    finally:
        _skip_oom.on = False
    if what in _skipped:
        _skipped.discard(what)
        log.warning("Redis has room again: %s written again", what)


T = TypeVar("T")
# what Redis answers about a key someone else broke, and what the log says of it: a key of
# another type, and a stream given the last possible id (XADD KEY 18446744073709551615-
# 18446744073709551615 ...), after which no XADD with '*' can ever add to it
_BROKEN = {
    "WRONGTYPE ": "held the wrong type",
    "exhausted the last possible ID": "had used up its stream ids",
}


def repaired(client: Any, key: str, command: Callable[[], T], default: T) -> T:
    """``command()`` on ``key``; if someone else broke the key (anyone with the run's keys
    can: it holds another Redis type, or it is a stream whose ids were used up), it is
    deleted (logged once a minute per key, :func:`warn_every`) and ``command()`` tried
    again; ``default`` if it is broken again at once, or if this user may not delete it (an
    ACL user that may only read the key). Deleting a stream loses what it held: its
    entries, and a consumer group with what it had pending (its consumers recreate it)."""
    for _ in range(3):
        try:
            return command()
        except ResponseError as e:  # a pipeline's error names its command first: find in it
            broken = next((why for reply, why in _BROKEN.items() if reply in str(e)), None)
            if broken is None:
                raise
        if not delete_broken(client, key, broken):
            break
    return default


def delete_broken(client: Any, key: str, broken: str = _BROKEN["WRONGTYPE "]) -> bool:
    """Delete ``key``, which someone else broke (``broken`` says how), logged once a minute
    per key (:func:`warn_every`); False if this user may not delete it."""
    warn_every(key, "%s %s (written by something else): deleting it", key, broken)
    try:
        client.delete(key)
    except NoPermissionError:
        return False
    return True
