"""Process numbers (``--id auto``): the smallest free number, kept alive while its process
runs, taken back from a dead holder of this host at once and from any other after its lease
ran out."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest

from qrl.runtime import ids
from qrl.runtime.ids import LEASE_TTL, claim_id, hold_id, holder
from tests.helpers import wait_until


def dead_pid() -> int:
    """The pid of a process of this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_numbers_count_up_from_zero_per_role(r, keys):
    leases = [claim_id(r, keys, "actor", 4) for _ in range(3)]
    assert [lease.ident for lease in leases] == [0, 1, 2]
    assert claim_id(r, keys, "worker", 4).ident == 0
    assert r.get(keys.lease("actor", 1)).decode() == holder()
    assert 0 < r.ttl(keys.lease("actor", 1)) <= LEASE_TTL


def test_a_released_number_is_taken_again(r, keys):
    leases = [claim_id(r, keys, "actor", 4) for _ in range(3)]
    leases[1].release()
    assert r.get(keys.lease("actor", 1)) is None
    assert claim_id(r, keys, "actor", 4).ident == 1
    assert claim_id(r, keys, "actor", 4).ident == 3


def test_a_dead_holder_of_this_host_gives_its_number_back_at_once(r, keys):
    host, pid, _ = holder().split(":")
    r.set(keys.lease("actor", 0), f"{host}:{dead_pid()}:ab", ex=LEASE_TTL)
    r.set(keys.lease("actor", 1), f"{host}:1:ab", ex=LEASE_TTL)  # alive (init)
    r.set(keys.lease("actor", 2), f"other-host:{dead_pid()}:ab", ex=LEASE_TTL)  # unknown
    r.set(keys.lease("actor", 3), f"{host}:{pid}:ab", ex=LEASE_TTL)  # this pid, before
    assert claim_id(r, keys, "actor", 4).ident == 0  # its process died
    assert claim_id(r, keys, "actor", 4).ident == 3  # a restarted container's process, same pid
    assert claim_id(r, keys, "actor", 4).ident == 4


def test_a_holder_whose_pid_is_now_a_thread_is_dead(r, keys):
    """A restarted container's new process can have a thread whose id is the old process's
    pid; kill(pid, 0) answers for a thread too, yet the old holder is gone (the compose
    smoke test once gave a restarted actor a new number for this)."""
    host, _, _ = holder().split(":")
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def body() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        done.wait(10)

    t = threading.Thread(target=body)
    t.start()
    try:
        ready.wait(5)
        r.set(keys.lease("actor", 0), f"{host}:{tid[0]}:ab", ex=LEASE_TTL)  # a thread now
        r.set(keys.lease("actor", 1), f"{host}:1:ab", ex=LEASE_TTL)  # a process (init)
        assert claim_id(r, keys, "actor", 4).ident == 0
        assert claim_id(r, keys, "actor", 4).ident == 2
    finally:
        done.set()
        t.join()


@pytest.mark.slow
def test_a_lease_lives_while_its_process_does(r, keys, monkeypatch, caplog):
    monkeypatch.setattr(ids, "LEASE_TTL", 1)
    key = keys.lease("actor", 0)
    lease = claim_id(r, keys, "actor", 4)
    time.sleep(2.5)  # on purpose: past its TTL, which only the keeping renews
    assert r.get(key).decode() == holder()
    r.delete(key)  # as if Redis had lost it: taken again
    mine = holder().encode()
    wait_until(lambda: r.get(key), "the lease to be taken again", 10, until=lambda v: v == mine)
    with caplog.at_level(logging.WARNING, "qrl.runtime.ids"):
        r.set(key, "other-host:1:ab", ex=1)  # another took it: left alone, with a warning
        wait_until(lambda: "held by another process" in caplog.text, "the keeper to see it", 10)
    assert r.get(key) == b"other-host:1:ab"
    lease.release()  # not its holder any more: the other's lease stays
    assert r.get(key) == b"other-host:1:ab"
    r.delete(key)
    before = set(threading.enumerate())
    lease = claim_id(r, keys, "actor", 4)
    (keeper,) = set(threading.enumerate()) - before
    lease.release()  # its keeping thread ended: nothing renews it
    assert lease.ident == 0 and r.get(key) is None and not keeper.is_alive()


def test_an_explicit_number_is_held_and_released(r, keys):
    explicit = hold_id(r, keys, "actor", 0)
    assert claim_id(r, keys, "actor", 4).ident == 1
    explicit.release()
    assert claim_id(r, keys, "actor", 4).ident == 0
    r.set(keys.lease("actor", 1), "other-host:5:ab", ex=LEASE_TTL)
    hold_id(r, keys, "actor", 1).release()  # held, then released
    assert r.get(keys.lease("actor", 1)) is None
