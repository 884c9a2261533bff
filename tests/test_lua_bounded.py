"""Every Lua script of qrl does bounded work, whatever a writer with the run's keys stored.

A Lua script blocks the whole redis-server while it runs (every client, every run), and one
that wrote before it looped cannot be killed (``SCRIPT KILL`` answers ``UNKILLABLE``). So
each script is driven here with hostile stored state (meta fields, counters, priorities,
lease keys, keys of the wrong type: huge, negative, non-numeric) and each call must return,
or raise a clean Redis error, with no command holding the server for :data:`LIMIT` (Redis's
own SLOWLOG says how long each held it; a call that never returns fails too).
The replay's scripts must not even raise: they repair what they find and carry on.

The scripts run on a private redis-server (one per module): an unbounded one would wedge
the session's for the other tests. A call that overruns gets that server killed and
restarted. ``test_every_script_is_covered`` fails when a new script appears in ``qrl/``
without a case here or in tests/test_lua_scripts.py (the scripts outside the replay).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qrl.replay.frames import FrameBatch, FrameLayout, FrameReplay, pack_frames
from qrl.replay.store import PrioritizedReplay
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import every_script
from tests.helpers import LAYOUT, make_records
from tests.lua_bounds import (  # the fixtures private and r: a redis-server of this module's own
    HOSTILE,
    WRONG_TYPES,
    bounded,
    fresh_keys,
    private_client,  # noqa: F401
    private_server,  # noqa: F401
)

CAP = 100
FRAMES = FrameLayout((4, 6, 6), "uint8", 6)


# what a hostile writer stores in a number's place
def frame_batch(n: int, seed: int = 0, size: int = 6) -> FrameBatch:
    """``n`` transitions of two env slots over distinct ``size`` x ``size`` frames."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 255, (n, 2 * 4, size, size), dtype=np.uint8)
    slots = np.arange(n) % 2
    fields = pack_frames(frames[:, :4], frames[:, 4:], slots)
    return FrameBatch(
        fields["frames"],
        fields["counts"],
        fields["refs"],
        rng.integers(0, 6, n).astype(np.int32),
        np.ones(n, np.float32),
        np.full(n, 0.9, np.float32),
    )


def plain(client: redis.Redis, keys: RunKeys, mode: str = "rank") -> PrioritizedReplay:
    return PrioritizedReplay(client, keys, LAYOUT, CAP, mode=mode, seed=0)  # type: ignore[arg-type]


def framed(client: redis.Redis, keys: RunKeys, mode: str = "rank") -> FrameReplay:
    return FrameReplay(client, keys, FRAMES, CAP, mode=mode, seed=0)


def insert(replay: PrioritizedReplay, n: int, batch: str = "") -> int:
    if isinstance(replay, FrameReplay):
        return replay.insert(frame_batch(n), np.ones(n), batch_id=batch)
    return replay.insert(make_records(range(n)), np.ones(n), batch_id=batch)


def still_works(r: redis.Redis, keys: RunKeys, make: Callable) -> None:
    """After whatever the hostile state did: the replay inserts, evicts within its capacity,
    samples and reports, and its meta holds whole numbers again."""
    replay = make(r, keys)
    for b in range(3):
        insert(replay, 60, f"after{b}")
    stats = replay.stats()
    assert 0 < stats["size"] <= 2 * CAP + 60  # what was there before may be kept once
    s = replay.sample(16)
    assert s is not None and len(s.ids) > 0
    meta = r.hgetall(keys.replay_meta)
    hi, lo = int(meta[b"hi"]), int(meta[b"lo"])
    assert 0 <= lo <= hi and hi - lo <= CAP


# -- the replay's insert scripts: meta fields


REPLAYS = {"plain": plain, "frames": framed}


@pytest.mark.parametrize("kind", REPLAYS)
def test_insert_after_a_huge_hi_is_bounded(private, r, kind):
    """Finding 1: ``HSET replay:meta hi 4000000`` made the next insert evict 4e6 ids."""
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 10)
    r.hset(keys.replay_meta, "hi", "4000000")
    out = bounded(private, lambda c: insert(make(c, keys), 10))
    assert isinstance(out, int)
    still_works(r, keys, make)


@pytest.mark.parametrize("kind", REPLAYS)
@pytest.mark.parametrize("field", ["hi", "lo", "clo", "inserted", "evicted", "batches"])
@pytest.mark.parametrize("value", HOSTILE, ids=[v[:24] for v in HOSTILE])
def test_insert_with_a_hostile_meta_field(private, r, kind, field, value):
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 30, "before")
    r.hset(keys.replay_meta, field, value)
    out = bounded(private, lambda c: insert(make(c, keys), 10, "hostile"))
    assert isinstance(out, int), out
    still_works(r, keys, make)


def _whole_or_text():
    return st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        st.integers(-(10**7), 10**7).map(str),
        st.floats(allow_nan=True).map(repr),
        st.text(max_size=20),
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(sorted(REPLAYS)),
    meta=st.dictionaries(st.sampled_from(["hi", "lo", "clo", "inserted"]), _whole_or_text()),
    ring=st.binary(max_size=64),
    n=st.integers(1, 2 * CAP),
)
def test_any_stored_meta_and_ring_give_a_bounded_insert(private, r, kind, meta, ring, n):
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 50, "before")
    if meta:
        r.hset(keys.replay_meta, mapping=meta)
    if ring:
        r.setrange(keys.replay_index, 0, ring)
    out = bounded(private, lambda c: insert(make(c, keys), n, "hostile"))
    assert isinstance(out, int), out
    still_works(r, keys, make)


REPLAY_KEYS = [
    "replay_priorities",
    "replay_data",
    "replay_meta",
    "replay_batches",
    "replay_index",
    "replay_frames",
]


@pytest.mark.parametrize("kind", REPLAYS)
@pytest.mark.parametrize("key", REPLAY_KEYS)
@pytest.mark.parametrize("wrong", WRONG_TYPES)
@pytest.mark.parametrize("mode", ["rank", "proportional"])
def test_replay_keys_of_the_wrong_type(private, r, kind, key, wrong, mode):
    """Every replay script (insert, both samplings) on a key of another type: repaired."""
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 30, "before")
    name = getattr(keys, key)
    r.delete(name)
    WRONG_TYPES[wrong](r, name)
    bounded(private, lambda c: make(c, keys, mode).sample(8))
    out = bounded(private, lambda c: insert(make(c, keys, mode), 10, "hostile"))
    assert isinstance(out, int), out
    bounded(private, lambda c: make(c, keys, mode).sample(8))
    still_works(r, keys, make)


BOGUS_MEMBERS = {
    "bogus": 1e4,
    "-1": float("inf"),
    "1e300": float("-inf"),
    "99999999999999999999": 1e308,
    "4.5": -1e308,
    "": 0.0,
    "x" * 300: 5.0,
}


@pytest.mark.parametrize("kind", REPLAYS)
@pytest.mark.parametrize("mode", ["rank", "proportional"])
def test_sampling_over_hostile_priorities(private, r, kind, mode):
    """Bogus members with extreme scores: each sample is bounded and does not raise; what
    it draws of them is removed."""
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 30, "before")
    r.zadd(keys.replay_priorities, BOGUS_MEMBERS)
    for _ in range(20):
        bounded(private, lambda c: make(c, keys, mode).sample(16))
        bounded(private, lambda c: make(c, keys, mode).mass())
    assert r.zcard(keys.replay_priorities) < 30 + len(BOGUS_MEMBERS)
    still_works(r, keys, make)


@pytest.mark.slow
def test_sampling_over_chunks_of_a_hostile_shape(private, r):
    """Chunks whose header claims as many LZ4 blocks as a u16 frame count allows, each with a
    row in the block table, under the size limit of Atari-sized frames: sampling 512 of them
    holds the server no longer than the limit, and what it drew is removed."""
    keys = fresh_keys()
    atari = FrameLayout((4, 84, 84), "uint8", 6)
    replay = FrameReplay(r, keys, atari, CAP, seed=0)
    n, blocks = 256, 2**16 - 1  # records, and blocks of one frame each (all empty)
    hostile = struct.pack("<BBHHI", 2, 1, n, blocks, 0) + bytes(n * atari.rec.itemsize)
    hostile += bytes(8 * blocks)
    assert len(hostile) <= atari.max_chunk()
    replay.insert(frame_batch(30, size=84), np.ones(30))
    for chunk in r.hkeys(keys.replay_frames):
        r.hset(keys.replay_frames, chunk, hostile)
    for _ in range(3):
        assert (
            bounded(private, lambda c: FrameReplay(c, keys, atari, CAP, seed=0).sample(512)) is None
        )
    assert r.zcard(keys.replay_priorities) < 30


# -- every script has its cases


# every script qrl runs, by its name in the registry (qrl/wire/scripts.py)
COVERED = {
    "streams.add_if_room",
    "streams.adopt",
    "streams.read",
    "streams.leave",
    "streams.ack",
    "streams.ensure_group",
    "streams.dead_letter",
    "replay.insert",
    "replay.fetch_ranks",
    "replay.sample_proportional",
    "frames.insert",
    "frames.fetch_ranks",
    "frames.sample_proportional",
    "ids.look",
    "ids.take",
    "ids.keep",
    "live.read",
    "live.set",
    "group.join",
    "group.look",
    "group.abandon",
    "chunks.publish",
    "chunks.kept",
    "inference.pop",
    "pbt.take",
    "pbt.hold",
    "metrics.range",
}


def test_every_script_is_covered():
    """Each Lua script qrl runs (each is declared once, in the registry) has cases above; a
    new one fails here until it gets some. The shared prelude of the replay's scripts runs
    in every one of them."""
    assert set(every_script()) == COVERED


@pytest.mark.parametrize("kind", REPLAYS)
def test_ids_near_the_top_start_again_from_0(private, r, kind):
    """Meta pushed up to the largest id: inserts repair it once and carry on from 0, not
    repair it at every insert."""
    keys, make = fresh_keys(), REPLAYS[kind]
    r.hset(keys.replay_meta, mapping={"hi": str(10**15 - 5), "lo": str(10**15 - 50)})
    for b in range(4):
        bounded(private, lambda c, b=b: insert(make(c, keys), 30, f"b{b}"))
    meta = r.hgetall(keys.replay_meta)
    assert int(meta[b"hi"]) == 90 and int(meta[b"lo"]) <= 60
