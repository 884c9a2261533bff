"""Process numbers (``--id auto``): the smallest free number, taken back from a dead
holder of this host at once and from any other after its lease ran out."""

from __future__ import annotations

import subprocess
import sys
import time

from qrl import ids
from qrl.ids import LEASE_TTL, claim_id, hold_id, holder, release
from qrl.metrics import report
from qrl.status import leave


def dead_pid() -> int:
    """The pid of a process of this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_numbers_count_up_from_zero_per_role(r, keys):
    assert [claim_id(r, keys, "actor") for _ in range(3)] == [0, 1, 2]
    assert claim_id(r, keys, "worker") == 0
    assert r.get(keys.lease("actor", 1)).decode() == holder()
    assert 0 < r.ttl(keys.lease("actor", 1)) <= LEASE_TTL


def test_a_released_number_is_taken_again(r, keys):
    for _ in range(3):
        claim_id(r, keys, "actor")
    release(r, keys, "actor", 1)
    assert r.get(keys.lease("actor", 1)) is None
    assert claim_id(r, keys, "actor") == 1
    assert claim_id(r, keys, "actor") == 3


def test_a_dead_holder_of_this_host_gives_its_number_back_at_once(r, keys):
    host, pid, _ = holder().split(":")
    r.set(keys.lease("actor", 0), f"{host}:{dead_pid()}:ab", ex=LEASE_TTL)
    r.set(keys.lease("actor", 1), f"{host}:1:ab", ex=LEASE_TTL)  # alive (init)
    r.set(keys.lease("actor", 2), f"other-host:{dead_pid()}:ab", ex=LEASE_TTL)  # unknown
    r.set(keys.lease("actor", 3), f"{host}:{pid}:ab", ex=LEASE_TTL)  # this pid, before
    assert claim_id(r, keys, "actor") == 0  # its process died
    assert claim_id(r, keys, "actor") == 3  # a restarted container whose process has its pid
    assert claim_id(r, keys, "actor") == 4


def test_a_live_holders_lease_outlives_its_ttl_through_heartbeats(r, keys, monkeypatch):
    monkeypatch.setattr(ids, "LEASE_TTL", 1)
    assert claim_id(r, keys, "actor") == 0
    for _ in range(3):  # 1.5 s: past the TTL, refreshed by the reports
        report(r, keys, "actor", 0, steps=1)
        time.sleep(0.5)
    r.set(keys.lease("actor", 0), "other-host:1", xx=True, keepttl=True)  # as if another took it
    report(r, keys, "actor", 0, steps=1)  # does not refresh a lease it no longer holds
    time.sleep(1.2)
    assert r.get(keys.lease("actor", 0)) is None  # expired: free again
    assert claim_id(r, keys, "actor") == 0


def test_an_explicit_number_is_held_and_a_clean_stop_frees_it(r, keys):
    hold_id(r, keys, "actor", 0)
    assert claim_id(r, keys, "actor") == 1
    leave(r, keys, "actor", 0)
    assert claim_id(r, keys, "actor") == 0
    r.set(keys.lease("actor", 1), "other-host:5", ex=LEASE_TTL)
    leave(r, keys, "actor", 1)  # not its holder any more: the lease stays
    assert r.get(keys.lease("actor", 1)) == b"other-host:5"
