"""The learner's data path (issue 36): batches written by sampler processes into a ring of
shared-memory slots and handed over by index; a slot is filled again only once the learner
gave it back; several sampler processes share the ring."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import struct
import time

import numpy as np
import pytest
import torch

from qrl.algos.impala.config import ImpalaConfig
from qrl.learners.impala import LOADER_NICE
from qrl.learners.replay import Batch
from qrl.replay.frames import layout_for
from qrl.replay.ring import NAP_S, BatchRing, Channel
from qrl.replay.sampler import Sampler
from qrl.replay.store import PrioritizedReplay, Sample
from qrl.runtime.runs import create_run
from tests.helpers import (
    LAYOUT,
    check_records,
    int_ids,
    make_learner,
    make_records,
    skip_or_fail,
    spec_of,
    wait_until,
)


def _fill_in_child(ring: BatchRing, n: int) -> None:
    for i in range(n):
        slot, _ = ring.take(0, timeout=30)
        ids = np.arange(i * 3, i * 3 + 3)
        rows, _ = LAYOUT.decode(make_records(ids), out=ring.view(slot))
        s = Sample([b"%d" % j for j in ids], rows, np.full(3, i, np.float32), np.zeros(3), 99)
        ring.put(slot, s)


def test_a_child_writes_batches_the_parent_reads_in_place():
    """The columns a spawned child wrote are read back in the parent exactly, as views of
    the shared pages (no copy), and the child can be no more than the slots ahead."""
    ctx = multiprocessing.get_context("spawn")
    ring = BatchRing(ctx, LAYOUT.dtype, rows=8, slots=2)
    child = ctx.Process(target=_fill_in_child, args=(ring, 5))
    child.start()
    try:
        first = ring.get(timeout=30)
        assert first is not None and not isinstance(first, str)
        second = ring.get(timeout=30)
        assert second is not None and not isinstance(second, str)
        assert ring.get(timeout=1) is None  # both slots held: the child waits
        base = np.frombuffer(ring.mem, np.uint8)
        for i, s in enumerate([first, second]):
            check_records(s.batch, range(i * 3, i * 3 + 3))
            assert (s.weights == i).all() and s.size == 99 and len(s.ids) == 3
            assert np.shares_memory(s.batch["obs"], base)
        held = {k: v.copy() for k, v in first.batch.items()}
        ring.release(second.slot)
        for i in range(2, 5):  # the child goes on through the one slot given back
            s = ring.get(timeout=30)
            assert s is not None and not isinstance(s, str) and s.slot == second.slot
            check_records(s.batch, range(i * 3, i * 3 + 3))
            ring.release(s.slot)
        for k, v in held.items():  # the held batch was never written over
            np.testing.assert_array_equal(first.batch[k], v)
    finally:
        child.join(30)
    assert child.exitcode == 0


def test_a_learner_batch_on_cpu_is_a_view_of_its_slot():
    """On CPU the learner's tensors are the slot's memory: no copy per update."""
    ring = BatchRing(multiprocessing.get_context("spawn"), LAYOUT.dtype, rows=4, slots=2)
    slot, _ = ring.take(0, timeout=1)
    rows, _ = LAYOUT.decode(make_records([1, 2, 3]), out=ring.view(slot))
    ring.put(slot, Sample([b"1", b"2", b"3"], rows, np.ones(3, np.float32), np.zeros(3), 3))
    s = ring.get(timeout=5)
    b = Batch(s, torch.device("cpu"))
    lo, hi = ring.address, ring.address + ring.nbytes
    for t in (b.obs, b.next_obs, b.ret, b.disc, b.weight):
        assert lo <= t.data_ptr() < hi
    assert b.obs.shape == (3, 4) and b.action.tolist() == [1, 2, 3] and b.slot == slot


def test_frame_batches_keep_their_columns_without_the_decode_flag():
    layout = layout_for((4, 84, 84), "uint8", 6)
    ring = BatchRing(multiprocessing.get_context("spawn"), layout.dtype, rows=2, slots=1)
    names = [n for n, _, _ in ring.columns]
    assert names == ["obs", "action", "ret", "disc", "next_obs", "weights", "priority"]
    assert ring.view(0)["obs"].shape == (2, 4, 84, 84) and ring.view(0)["obs"].dtype == np.uint8
    assert all(off % 64 == 0 for off in ring.offsets)


def test_two_sampler_processes_fill_one_ring_and_one_writes_priorities(r, keys, redis_server):
    replay = PrioritizedReplay(r, keys, LAYOUT, 1000)
    replay.insert(make_records(range(200)), np.ones(200))
    sampler = Sampler(spec_of(redis_server.url, keys), samplers=2, prefetch=3)
    try:
        assert len(set(sampler.pids)) == 2
        for _ in range(30):
            s = sampler.get(timeout=30)
            assert s is not None and len(s.ids) == 16
            check_records(s.batch, int_ids(s.ids))
            sampler.release(s.slot)
        s = sampler.get(timeout=30)
        sampler.release(s.slot, np.full(len(s.ids), 500.0, np.float32))
    finally:
        sampler.stop()  # writes the priorities given back
    assert set(r.zmscore(keys.replay_priorities, s.ids)) == {500.0}


def test_feed_processes_run_as_batch_processes(r, keys, redis_server):
    """The samplers and the unroll learners' loader never preempt the learner as they wake
    (SCHED_BATCH, qrl.replay.feed); the loader keeps its added niceness."""
    if not hasattr(os, "SCHED_BATCH"):
        skip_or_fail("no SCHED_BATCH: Linux's scheduling policies")
    with contextlib.ExitStack() as started:  # each feed stopped, whatever fails after it
        sampler = Sampler(spec_of(redis_server.url, keys), samplers=2)
        started.callback(sampler.stop)
        cfg = ImpalaConfig()
        create_run(r, keys, "impala", cfg)
        loader = make_learner(redis_server.url, keys, cfg).source.source.open()
        started.callback(loader.stop)
        pids = [*sampler.pids, *loader.pids]
        assert len(pids) == 3
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        wait_until(
            lambda: [os.sched_getscheduler(p) for p in pids],
            "batch policy",
            30,
            until=lambda got: got == [os.SCHED_BATCH] * 3,
        )
        wait_until(
            lambda: os.getpriority(os.PRIO_PROCESS, loader.pids[0]),
            "niceness",
            30,
            until=lambda n: n == min(mine + LOADER_NICE, 19),
        )


def _write_big_then_die(ch: Channel, blob: bytes) -> None:
    ch.put(["whole", blob])  # more than the pipe holds: written as the reader takes it
    os.write(ch._w.fileno(), struct.pack("!I", 10_000) + b"cut")  # a message's start only
    os._exit(0)  # as if killed in the middle of writing the rest


@pytest.mark.parametrize("nap", [0.0, NAP_S], ids=["waits", "naps"])
def test_a_message_cut_by_a_dying_writer_never_blocks_the_reader(nap):
    """A message longer than the pipe's atomic write (4 KiB) can be cut by a writer killed
    while writing it. The reader returns only whole messages and, for the part, ``None``
    after its timeout as for no message (reading it as a message had the learner block for
    ever, its feed's death unseen). A whole message larger than the pipe arrives whole."""
    import threading

    ctx = multiprocessing.get_context("spawn")
    ch = Channel(ctx, nap=nap)
    blob = bytes(range(256)) * 1024  # 256 KiB: four times the pipe's 64 KiB
    child = ctx.Process(target=_write_big_then_die, args=(ch, blob))
    child.start()
    got: list = []
    reader = threading.Thread(target=lambda: got.extend([ch.get(30), ch.get(0.5)]), daemon=True)
    reader.start()
    reader.join(40)
    child.join(10)
    assert not reader.is_alive(), "the reader blocked on the cut message"
    assert got == [["whole", blob], None]
    assert not ch.ready()


def _put_after(ch: Channel, delay: float) -> None:
    time.sleep(delay)  # on purpose: the put must land while the reader naps, not before
    ch.put("back")


def test_a_napping_reader_takes_what_comes_and_gives_up_on_time():
    """A reader that naps (a slot's owner) gets a message another process puts while it
    sleeps, and returns ``None`` once its timeout is up with nothing come."""
    ctx = multiprocessing.get_context("spawn")
    ch = Channel(ctx, nap=NAP_S)
    assert ch.get(0.05) is None
    child = ctx.Process(target=_put_after, args=(ch, 0.3))
    child.start()
    try:
        assert ch.get(30) == "back"
    finally:
        child.join(10)


def _wchan(pid: int) -> str:
    with open(f"/proc/{pid}/wchan") as f:
        return f.read().strip()


def _read_one(ch: Channel, reading) -> None:
    reading.set()
    assert ch.get(60) == "done"


@pytest.mark.parametrize("naps, where", [(60.0, "sleep"), (0.003, "poll")])
def test_a_napping_reader_sleeps_outside_the_pipe_then_waits_in_it(naps, where):
    """A slot's owner waiting for it naps (``hrtimer_nanosleep``), not in the pipe's wait queue,
    so a give-back meanwhile has no process to wake, the dearer part of it
    (notes/benchmarks-notebook.md, "The owners nap"); after ``naps`` seconds it waits in
    ``poll``, burning nothing while the learner is quiet."""
    if not os.path.exists("/proc/self/wchan"):
        skip_or_fail("no /proc/PID/wchan to see where a process waits")
    ctx = multiprocessing.get_context("spawn")
    ch, reading = Channel(ctx, nap=NAP_S, naps=naps), ctx.Event()
    child = ctx.Process(target=_read_one, args=(ch, reading))
    child.start()
    try:
        assert reading.wait(30)
        seen = set()

        def waits_there() -> bool:  # (for "poll": past its naps)
            seen.add(state := _wchan(child.pid))
            return where in state

        try:
            wait_until(waits_there, f"the reader to wait in {where}", 10, every=0.002)
        except AssertionError:
            if seen <= {"0", ""}:
                skip_or_fail("the kernel hides wchan here")
            raise
        seen = set()
        for _ in range(100):
            seen.add(_wchan(child.pid))
            time.sleep(0.002)  # samples over 0.2 s on purpose: where it waits must not change
        polled = any("poll" in w or "select" in w for w in seen)
        slept = any("sleep" in w for w in seen)
        assert (slept and not polled) if where == "sleep" else (polled and not slept), seen
        ch.put("done")
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
