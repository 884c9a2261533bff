"""Process numbers of a run (``--id auto``) and the leases that keep them.

A process holds its number by a lease, ``qrl:{RUN}:lease:ROLE.ID``: a string naming the
holder (``HOST:PID:TOKEN``) with a short TTL, kept alive by a thread of the process for as
long as it runs (waiting for weights included) and deleted when it ends. :func:`claim_id`
gives a joining process the smallest number whose lease is free: one nobody holds, one
whose holder stopped keeping it for :data:`LEASE_TTL` seconds, or one held by a dead
process of this host. So
a restarted container (same host name, its old process gone) takes its own number back at
once, and the numbers of a run (and with them the Ape-X actors' epsilons) stay within the
count of processes it has, however often they restart.

Processes that share a host name must share a process-id namespace (as the containers of
one compose project and the processes of ``qrl train`` do): a holder on this host whose pid
is not running here is taken to be dead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import threading
from pathlib import Path

import redis

from qrl.connection import RedisUnavailable
from qrl.keys import RunKeys

log = logging.getLogger(__name__)

LEASE_TTL = 10  # seconds a number stays taken after its holder last kept it alive
_SCAN = 64  # leases read per round trip while looking for a free number

# take KEYS[1] for ARGV[1] if it still holds ARGV[3] ('' = nothing); ARGV[2] = TTL
_TAKE = """
local cur = redis.call('GET', KEYS[1]) or ''
if cur ~= ARGV[3] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""
# keep KEYS[1] for ARGV[1] another ARGV[2] seconds (taking it again if it ran out), unless
# another holds it; without ARGV[2], delete it if ARGV[1] holds it
_KEEP = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
if not ARGV[2] then return redis.call('DEL', KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""

_HOST = socket.gethostname()
_tokens: dict[int, str] = {}  # pid -> its token (forked processes inherit the module)


def holder() -> str:
    """This process, as a lease names it: ``HOST:PID:TOKEN``, the token drawn once per
    process (a restarted container can give its new process the old one's pid)."""
    pid = os.getpid()
    return f"{_HOST}:{pid}:{_tokens.setdefault(pid, secrets.token_hex(4))}"


def _dead_here(name: str) -> bool:
    """Whether the holder ``name`` is a process of this host that is gone."""
    host, pid = (name.rsplit(":", 2) + [""])[:2]
    if host != _HOST or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return name != holder()  # this pid's previous process
    return not _process_alive(int(pid))


def _process_alive(pid: int) -> bool:
    """Whether a process has this pid. On Linux a thread's id answers ``kill(pid, 0)`` too
    (a restarted container's new process may have a thread with its old process's pid), so
    a pid whose ``/proc`` entry names another thread-group leader is no process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no /proc to ask: kill said it is there
    tgid = re.search(r"^Tgid:\s*(\d+)", status, re.MULTILINE)
    return tgid is None or int(tgid.group(1)) == pid


class Lease:
    """Number ``ident`` of ``role``, held by this process: a daemon thread keeps the lease
    alive every third of its TTL until :meth:`release`."""

    def __init__(self, client: redis.Redis, keys: RunKeys, role: str, ident: int) -> None:
        self.client, self.key, self.ident, self.me = (
            client,
            keys.lease(role, ident),
            ident,
            holder(),
        )
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._keep, name=f"lease-{role}.{ident}", daemon=True
        )
        self._thread.start()

    def _keep(self) -> None:
        lost = False
        while not self._done.wait(LEASE_TTL / 3):
            try:
                kept = self.client.eval(_KEEP, 1, self.key, self.me, LEASE_TTL)
            except (redis.RedisError, RedisUnavailable):
                continue  # Redis away: the roles report it; the lease is taken again after
            if not kept and not lost:
                log.warning("%s is held by another process now", self.key)
            lost = not kept

    def release(self) -> None:
        """Give the number back, if this process still holds it."""
        self._done.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError, RedisUnavailable):  # else it runs out
            self.client.eval(_KEEP, 1, self.key, self.me)


def claim_id(client: redis.Redis, keys: RunKeys, role: str) -> Lease:
    """The smallest free number of ``role`` in the run, taken for this process."""
    take = client.register_script(_TAKE)
    me = holder()
    start = 0
    while True:
        ids = range(start, start + _SCAN)
        for ident, cur in zip(ids, client.mget([keys.lease(role, i) for i in ids]), strict=True):
            current = "" if cur is None else cur.decode() if isinstance(cur, bytes) else cur
            if (not current or _dead_here(current)) and take(
                keys=[keys.lease(role, ident)], args=[me, LEASE_TTL, current]
            ):
                return Lease(client, keys, role, ident)
        start += _SCAN


def hold_id(client: redis.Redis, keys: RunKeys, role: str, ident: int) -> Lease:
    """Take number ``ident`` of ``role`` (an explicit ``--id``), whoever holds it."""
    client.set(keys.lease(role, ident), holder(), ex=LEASE_TTL)
    return Lease(client, keys, role, ident)
