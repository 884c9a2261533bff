"""Process numbers of a run (``--id auto``) and the leases that keep them.

A process holds its number by a lease, ``qrl:{RUN}:lease:ROLE.ID``: a string naming the
holder (``HOST:PID:TOKEN``) with a short TTL, kept alive by a thread of the process for as
long as it runs (waiting for weights included) and deleted when it ends. :func:`claim_id`
gives a joining process the smallest number whose lease is free: one nobody holds, one
whose holder stopped keeping it for :data:`LEASE_TTL` seconds, or one held by a dead
process of this host. So
a restarted container (same host name, its old process gone) takes its own number back at
once, and the numbers of a run (and with them the Ape-X actors' epsilons) stay within the
count of processes it has, however often they restart. Whatever is stored, they stay below
:func:`id_limit` of the count the run is configured for, and a lease key qrl did not write
(another type, no TTL or a longer one) is garbage, taken over; the scripts look at one
lease each, or one bounded chunk of them.

Processes that share a host name must share a process-id namespace (as the containers of
one compose project and the processes of ``qrl train`` do): a holder on this host whose pid
is not running here is taken to be dead.

A process that connects as a per-instance ACL user, ``RUN.ROLE.N`` (``qrl run join``,
:func:`instance_user`), may reach lease ``N`` of its role only: it takes that number and no
other (:func:`user_ident`, ``only`` of :func:`claim_id`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path

import redis

from qrl.wire.connection import RedisUnavailable
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import Lua

log = logging.getLogger(__name__)

LEASE_TTL = 10  # seconds a number stays taken after its holder last kept it alive
_SCAN = 64  # leases read per round trip while looking for a free number
_FULL_WAIT = 0.5  # seconds between looks while every number up to the limit is held

# the scripts of the leases (qrl/wire/lua/ids.*.lua, each after ids.holder's check of what a
# lease holds): claim_id looks at a chunk of them and takes a free one, Lease keeps and
# releases its own
LOOK = Lua("ids.look", "ids.holder", "ids.look")
TAKE = Lua("ids.take", "ids.holder", "ids.take")
KEEP = Lua("ids.keep", "ids.holder", "ids.keep")


def id_limit(count: int) -> int:
    """How many numbers :func:`claim_id` hands out for a role the run is configured to have
    ``count`` processes of (an explicit ``--id`` and ``qrl run join`` are bounded the same,
    and the run's metrics readers follow these numbers' streams): twice that, plus 8.
    Twice, since a process restarted on another host gets a new number while its old lease
    lives out its TTL (a rolling restart of all of them at once); 8 for processes started
    by hand beside the configured ones. Never
    more: numbers feed seeds and epsilons, and fake leases must not make them grow."""
    return 2 * max(count, 1) + 8


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
                kept = KEEP(self.client, [self.key], [self.me, LEASE_TTL, "keep"])
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
            KEEP(self.client, [self.key], [self.me, LEASE_TTL, "release"])


def instance_user(run: str, role: str, ident: int) -> str:
    """The per-instance ACL user of process ``ident`` of ``role`` in ``run``: ``RUN.ROLE.N``."""
    return f"{run}.{role}.{ident}"


def user_ident(user: str | None, run: str, role: str) -> int | None:
    """The process number a per-instance user (:func:`instance_user`) of ``role`` in ``run``
    stands for; ``None`` for any other user (a role's shared one, the admin)."""
    head, _, number = (user or "").rpartition(".")
    if head != f"{run}.{role}" or not number.isdigit() or number != str(int(number)):
        return None
    return int(number)


def claim_id(
    client: redis.Redis, keys: RunKeys, role: str, count: int, only: int | None = None
) -> Lease:
    """The smallest free number of ``role`` in the run, taken for this process, below
    :func:`id_limit` of the ``count`` of such processes the run is configured for (``only``:
    that number, a per-instance user's); while every one of them is held, it waits (one
    warning)."""
    look, take = LOOK.on(client), TAKE.on(client)
    me, limit, waiting = holder(), id_limit(count), False
    numbers = range(limit) if only is None else range(only, only + 1)
    while True:
        for start in range(numbers.start, numbers.stop, _SCAN):
            names = [keys.lease(role, i) for i in range(start, min(start + _SCAN, numbers.stop))]
            for n, cur in enumerate(look(keys=names, args=[LEASE_TTL])):
                current = cur.decode() if isinstance(cur, bytes) else str(cur)
                if current and not _dead_here(current):
                    continue
                taken = take(keys=[names[n]], args=[me, LEASE_TTL, current])
                if taken == 2:
                    log.warning("%s held garbage (the wrong type or TTL): taken", names[n])
                if taken:
                    return Lease(client, keys, role, start + n)
        if not waiting:
            waiting = True
            log.warning(
                "every number of %s from %d to %d is held (the run is configured for %d): "
                "waiting for one to be free",
                role,
                numbers.start,
                numbers.stop - 1,
                count,
            )
        time.sleep(_FULL_WAIT)


def hold_id(client: redis.Redis, keys: RunKeys, role: str, ident: int) -> Lease:
    """Take number ``ident`` of ``role`` (an explicit ``--id``), whoever holds it."""
    client.set(keys.lease(role, ident), holder(), ex=LEASE_TTL)
    return Lease(client, keys, role, ident)
