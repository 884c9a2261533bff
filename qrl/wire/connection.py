"""Connecting to Redis from a URL, with retry and backoff on connection loss and while
Redis is out of memory or busy running a script (:mod:`qrl.wire.faults`)."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import sys
import threading
import time
from urllib.parse import quote, unquote

import redis
from redis.backoff import AbstractBackoff, ExponentialBackoff
from redis.connection import parse_url
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
    OutOfMemoryError,
    RedisClusterException,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from qrl.wire.cluster import RETRY_ON, ClusterClient
from qrl.wire.faults import BusyError, OutageRetry, ScriptsMissing, out_of_memory

log = logging.getLogger(__name__)

ENV_URL = "QRL_REDIS_URL"
ENV_PASSWORD = "QRL_REDIS_PASSWORD"
ENV_PASSWORD_FILE = "QRL_REDIS_PASSWORD_FILE"
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
_stopping = threading.Event()
os.register_at_fork(after_in_child=_stopping.clear)


def stop_waiting() -> None:
    """This process is stopping: from now on a lost Redis is not waited for, a failing
    command raises :class:`RedisUnavailable` at once (so a role asked to stop while Redis
    is away writes its checkpoint and ends instead of retrying until the deadline)."""
    _stopping.set()


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
        self._full_url = url  # only to take its secrets out of error messages
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
        what = redact_text(str(error), self._full_url)
        state = "not answering"
        if out_of_memory(error):
            state = "is out of memory"
        elif isinstance(error, BusyError):
            state = "is busy running a script"
        # only the admin ends this one (it loads the scripts), so no deadline: every role
        # of the run waits for it instead of exiting
        missing = isinstance(error, ScriptsMissing)
        if missing:
            state = "lacks qrl's Lua scripts"
        now = time.monotonic()
        self._local.armed = False
        if failures == 1 or getattr(self._local, "since", None) is None:
            self._local.since = now
            with _outage_lock:
                if self.url not in _outages:
                    _outages[self.url] = now
                    log.warning(
                        "Redis at %s %s (%s); retrying with backoff %s",
                        self.url,
                        state,
                        what,
                        "until it has them" if missing else f"for up to {self.deadline:.0f}s",
                    )
        if _stopping.is_set():
            self._local.since = None
            raise RedisUnavailable(
                f"Redis at {self.url} {state} ({what}) and this process is stopping: "
                "not waiting for it"
            ) from error
        if now - self._local.since > self.deadline and not missing:
            self._local.since = None
            raise RedisUnavailable(
                f"Redis at {self.url} has not answered for {self.deadline:.0f}s "
                f"({what}); giving up (set {ENV_DEADLINE} to wait longer)"
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


def url_user(url: str | None) -> str | None:
    """The ACL user ``url`` (``None``: :func:`default_url`) names; ``None``: the default."""
    return parse_url(url or default_url()).get("username")


def with_user(url: str, user: str, password: str) -> str:
    """``url`` connecting as ``user`` with ``password`` (both percent-encoded), in place of
    whatever userinfo it had."""
    scheme, sep, rest = url.partition("://")
    host = rest.rpartition("@")[2]
    return f"{scheme}{sep}{quote(user, safe='')}:{quote(password, safe='')}@{host}"


# a query parameter that carries a secret: password=, ssl_password=, ...
_QUERY_SECRET = re.compile(r"(?i)([?&;][^=&#;]*password=)[^&;]*")  # to the next parameter


def _userinfo(url: str) -> tuple[str, str, str] | None:
    """``(scheme://, userinfo, @rest)`` of ``url``, or None if it has no userinfo. The
    userinfo runs to the *last* ``@``, so a password with ``#``, ``/``, ``?`` or ``@`` in
    it (which a URL should percent-encode, but people do not) is never cut short."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return None
    userinfo, _, host = rest.rpartition("@")
    return scheme + sep, userinfo, "@" + host


_USER = re.compile(r"[\w.~%!$&'()*+,;=-]*")  # what a user name in a URL may hold


def _user_and_secret(userinfo: str) -> tuple[str | None, str]:
    """A userinfo's user name (None where there is none to show: no ``:``, or a "name" with
    characters a user name cannot have, so really part of the password) and its secret."""
    user, colon, password = userinfo.partition(":")
    if colon and _USER.fullmatch(user):
        return user, password
    return None, userinfo


def _secrets(url: str) -> list[str]:
    """What in ``url`` is secret, longest first: the password of its userinfo (as written,
    decoded, and its pieces between URL delimiters) and ``password=`` query values."""
    found = [m.group(0).split("=", 1)[1] for m in _QUERY_SECRET.finditer(url)]
    parts = _userinfo(_QUERY_SECRET.sub(r"\1***", url))  # as redact() reads it
    if parts is not None:
        password = _user_and_secret(parts[1])[1]
        found += [password, unquote(password), *re.split(r"[#/?@:&=]", password)]
    return sorted({s for s in found if len(s) >= 3 and s != "***"}, key=len, reverse=True)


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def redact(url: str) -> str:
    """``url`` without its secrets, for logs and messages: any ``password=`` query parameter
    becomes ``***``, and so does the password of the userinfo (``redis://user:***@host:6379/0``;
    a userinfo that is not ``name:password`` may be a password: all of it)."""
    out = _QUERY_SECRET.sub(r"\1***", url)
    parts = _userinfo(out)
    if parts is not None:
        scheme, userinfo, rest = parts
        user = _user_and_secret(userinfo)[0]
        out = f"{scheme}***{rest}" if user is None else f"{scheme}{user}:***{rest}"
    return _scrub(out, _secrets(url))  # whatever an unencoded password left behind


def redact_text(text: str, url: str) -> str:
    """``text`` (e.g. an error message about ``url``) with ``url`` redacted and every piece
    of its secrets that may have leaked into it (a URL parser that misread an unencoded
    password reports its pieces as host or port) replaced by ``***``."""
    return _scrub(text.replace(url, redact(url)), _secrets(url))


def is_loopback(bind: str) -> bool:
    """True if every address in ``bind`` (redis-server's ``--bind``: addresses separated by
    spaces) is a loopback address, reachable only from this machine."""
    addresses = bind.split()

    def loopback(address: str) -> bool:
        try:
            return ipaddress.ip_address(address.removeprefix("-")).is_loopback
        except ValueError:
            return address == "localhost"

    return bool(addresses) and all(map(loopback, addresses))


_warned: set[str] = set()  # the redis:// URLs this process warned about


def _warn_plain_text(url: str, host: str) -> None:
    """A password over ``redis://`` to another machine: anyone on the way reads it (and
    every payload). Said once per URL and process."""
    if not is_loopback(host) and url not in _warned:
        _warned.add(url)
        log.warning(
            "sending the Redis password to %s in plain text (redis://): anyone on the network "
            "can read it and every payload; use TLS (rediss://, docs/many-machines.md)",
            redact(url),
        )


def env_password() -> str | None:
    """The Redis password from ``QRL_REDIS_PASSWORD``, else from the file that
    ``QRL_REDIS_PASSWORD_FILE`` names (e.g. a docker secret), else None. Either keeps it
    out of the command line, where anyone on the machine can read it (``ps``)."""
    password = os.environ.get(ENV_PASSWORD)
    if password:
        return password
    path = os.environ.get(ENV_PASSWORD_FILE)
    return read_password_file(path) if path else None


def read_password_file(path: str | os.PathLike[str]) -> str:
    """The password in a file: its first line, without the line end."""
    try:
        with open(path, encoding="utf-8") as f:
            password = f.readline().rstrip("\r\n")
    except OSError as e:
        raise RedisUnavailable(f"cannot read the password file {path}: {e.strerror}") from None
    if not password:
        raise RedisUnavailable(f"the password file {path} is empty")
    return password


_LOST = (RedisConnectionError, RedisTimeoutError, OSError)  # a lost connection
_OUTAGE = (*_LOST, OutOfMemoryError, BusyError)  # what is waited out, up to the deadline
Client = redis.Redis | ClusterClient  # what connect() gives: one node's client or a cluster's


def connect(
    url: str | None = None,
    *,
    wait: float = 0.0,
    deadline: float | None = None,
    socket_timeout: float | None = 30.0,
) -> Client:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://``; user and password in
    the URL), checked with PING. Where ``url`` names a node of a Redis Cluster, the client
    is a :class:`qrl.wire.cluster.ClusterClient` for the whole cluster
    (see :mod:`qrl.wire.cluster`).

    Commands that fail on a lost connection, on Redis out of memory (``maxmemory`` with
    ``noeviction``) or busy (a script past its time limit: outages too), are retried with
    exponential backoff (up to 2 s apart) for up to ``deadline`` seconds (default
    :func:`redis_deadline`), then raise :class:`RedisUnavailable`. If Redis does not answer
    at first, PING is tried again for up to ``wait`` seconds, then :class:`RedisUnavailable`
    is raised with a clear message.
    """
    url = url or default_url()
    backoff = DeadlineBackoff(url, wait)  # the first PING waits at most ``wait``
    options: dict[str, object] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": 5.0,
        "health_check_interval": 30,
    }
    if url.startswith("rediss://"):
        options["ssl_check_hostname"] = True  # unless the URL says ?ssl_check_hostname=false
    try:
        if "password" not in (parsed := parse_url(url)) and (password := env_password()):
            options["password"] = password
        client: Client = redis.Redis.from_url(
            url,
            retry=OutageRetry(backoff, -1, _OUTAGE),
            retry_on_error=list(_OUTAGE),
            **options,
        )
    except ValueError as e:
        raise RedisUnavailable(f"bad Redis URL {redact(url)!r}: {redact_text(str(e), url)}") from e
    if url.startswith("redis://") and "password" in (parsed | options):
        _warn_plain_text(url, parsed.get("host", ""))
    try:
        client.ping()
        cluster = _cluster_enabled(client)
    except (RedisUnavailable, RedisConnectionError, RedisTimeoutError, OSError) as e:
        raise _unreachable(url, e) from e
    except ResponseError as e:  # a cluster node refuses SELECT of another database
        if "cluster" not in str(e).lower():
            raise
        cluster = True
    if cluster:
        client.close()
        if parsed.get("db", 0) != 0:
            raise RedisUnavailable(
                f"{redact(url)} is a node of a Redis Cluster, which has only database 0: "
                f"end the URL with /0, not /{parsed['db']}"
            )
        retry = OutageRetry(backoff, -1, (*RETRY_ON, OutOfMemoryError, BusyError))
        client = _cluster_client(url, retry, wait, options)
    backoff.deadline = redis_deadline() if deadline is None else deadline
    return client


def _cluster_client(url: str, retry: OutageRetry, wait: float, options: dict) -> ClusterClient:
    """The cluster's client, once its slot map covers every slot: a cluster still being
    formed (its nodes up, not yet joined) is waited for up to ``wait`` seconds too."""
    until = time.monotonic() + wait
    while True:
        try:
            return ClusterClient(url, retry=retry, **options)
        except (RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException) as e:
            if time.monotonic() >= until:
                raise _unreachable(url, e) from e
            time.sleep(0.2)


def _unreachable(url: str, error: BaseException) -> RedisUnavailable:
    cause = error.__cause__ or error
    return RedisUnavailable(
        f"cannot reach Redis at {redact(url)}: {redact_text(str(cause), url)}. Start one "
        f"with `qrl redis`, pass --redis URL, or set {ENV_URL}."
    )


def _cluster_enabled(client: redis.Redis) -> bool:
    """Whether the node ``client`` talks to runs in cluster mode. ``CLUSTER INFO`` answers on
    a cluster node, fails on any other (and is allowed to a user that ``-@dangerous`` keeps
    from ``INFO``); a user not allowed ``CLUSTER INFO`` either is taken to be on one node."""
    try:
        client.execute_command("CLUSTER INFO")
    except ResponseError:  # NOPERM included
        return False
    return True


def disconnect(client: Client) -> None:
    """Close every connection ``client`` has open (before forking: a child opens its own)."""
    if isinstance(client, ClusterClient):
        client.disconnect()
    else:
        client.connection_pool.disconnect()
