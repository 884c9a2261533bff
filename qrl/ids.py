"""Process numbers of a run (``--id auto``) and the leases that keep them.

A process holds its number by a lease, ``qrl:{RUN}:lease:ROLE.ID``: a string naming the
holder (``HOST:PID:TOKEN``) with a short TTL that every heartbeat refreshes
(:func:`qrl.status.beat`), and that a clean stop deletes. :func:`claim_id` gives a joining
process the smallest number whose lease is free: one nobody holds, one whose holder stopped
refreshing it for :data:`LEASE_TTL` seconds, or one held by a dead process of this host. So
a restarted container (same host name, its old process gone) takes its own number back at
once, and the numbers of a run (and with them the Ape-X actors' epsilons) stay within the
count of processes it has, however often they restart.

Processes that share a host name must share a process-id namespace (as the containers of
one compose project and the processes of ``qrl train`` do): a holder on this host whose pid
is not running here is taken to be dead.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

import redis

from qrl.keys import RunKeys

LEASE_TTL = 10  # seconds a number stays taken after its holder's last heartbeat
_SCAN = 64  # leases read per round trip while looking for a free number

# take KEYS[1] for ARGV[1] if it still holds ARGV[3] ('' = nothing); ARGV[2] = TTL
_TAKE = """
local cur = redis.call('GET', KEYS[1]) or ''
if cur ~= ARGV[3] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""
# refresh KEYS[1] for ARGV[2] seconds, or without ARGV[2] delete it, if ARGV[1] holds it
_KEEP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return redis.call('DEL', KEYS[1])
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
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def claim_id(client: redis.Redis, keys: RunKeys, role: str) -> int:
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
                return ident
        start += _SCAN


def hold_id(client: redis.Redis, keys: RunKeys, role: str, ident: int) -> None:
    """Take number ``ident`` of ``role`` (an explicit ``--id``), whoever holds it."""
    client.set(keys.lease(role, ident), holder(), ex=LEASE_TTL)


def refresh(pipe: Any, keys: RunKeys, role: str, ident: int) -> None:
    """Queue the refresh of this process's lease on ``pipe`` (with its heartbeat)."""
    pipe.eval(_KEEP, 1, keys.lease(role, ident), holder(), LEASE_TTL)


def release(client: redis.Redis, keys: RunKeys, role: str, ident: int) -> None:
    """Give the number back (a clean stop), if this process still holds it."""
    client.eval(_KEEP, 1, keys.lease(role, ident), holder())
