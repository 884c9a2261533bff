"""The prioritized replay against hostile entries (issue 28, finding 4): whatever a writer
with the run's keys plants in the sorted set or the records is removed, counted and skipped
when drawn, on one node, per shard, for sequences and in the sampler process."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import redis

from qrl.replay.sampler import Sampler, SamplerSpec
from qrl.replay.sequences import SequenceLayout
from qrl.replay.shards import ShardedReplay
from qrl.replay.store import (
    PrioritizedReplay,
    RecordLayout,
)
from tests.helpers import (
    LAYOUT,
    check_records,
    int_ids,
    make_records,
)

# -- hostile entries (issue 28, finding 4): removed, counted and skipped


def plant_bogus(r, keys, layout: RecordLayout) -> set[bytes]:
    """What a writer with the run's keys can add: a member that is no id (top priority),
    a record of the wrong size and one with a NaN; returns those members."""
    r.zadd(keys.replay_priorities, {"bogus": 1e4, "3": 1e4, "4": 1e4})
    r.hset(keys.replay_data, "3", b"short")
    nan = bytearray(r.hget(keys.replay_data, "5"))
    nan[-4:] = np.float32(np.nan).tobytes()  # the last float of the record
    r.hset(keys.replay_data, "4", bytes(nan[: layout.size]))
    return {b"bogus", b"3", b"4"}


@pytest.mark.parametrize("mode", ["rank", "proportional"])
def test_bogus_draws_are_removed_counted_and_skipped(r, keys, mode):
    layout = RecordLayout((4,), "float32", n_actions=100)  # make_records: action = id
    replay = PrioritizedReplay(r, keys, layout, 100, mode=mode, seed=1)
    replay.insert(make_records(range(20)), np.ones(20))
    bogus = plant_bogus(r, keys, layout)
    r.hset(keys.replay_data, "6", make_records([100])[0])  # an action the net does not have
    r.zadd(keys.replay_priorities, {"6": 1e4})
    bogus.add(b"6")
    samples = [replay.sample(16) for _ in range(50)]
    assert samples[-1] is not None  # None only while all a batch drew was bogus
    for s in filter(None, samples):
        assert not bogus & set(s.ids)
        check_records(s.batch, int_ids(s.ids))
        assert s.weights.max() == 1.0 and len(s.weights) == len(s.ids) == len(s.probs)
    for m in bogus:
        assert r.zscore(keys.replay_priorities, m) is None
        assert not r.hexists(keys.replay_data, m)
    assert int(r.hget(keys.stats, "rejected:replay")) == len(bogus)
    assert int(r.hget(keys.stats, "rejected")) == len(bogus)
    assert r.xlen(keys.deadletter) == len(bogus)
    assert replay.size() == 20 - 3  # 3, 4 and 6 were transitions: gone with their records


def test_sharded_replay_removes_bogus_draws_from_their_shard(r, keys):
    replay = ShardedReplay(r, keys, LAYOUT, 200, shards=2, seed=0)
    for part in replay.parts:
        part.insert(make_records(range(20)), np.ones(20))
    shard1 = replay.parts[1].keys
    bogus = plant_bogus(r, shard1, LAYOUT)
    for _ in range(50):
        s = replay.sample(16)
        assert not {b"1:" + m for m in bogus} & set(s.ids)
        check_records(s.batch, [int(i.partition(b":")[2]) for i in s.ids])
    assert int(r.hget(shard1.stats, "rejected:replay")) == len(bogus)
    assert r.zcard(shard1.replay_priorities) == 18


def test_sequence_replay_removes_records_of_the_wrong_size(r, keys):
    """R2D2's sequences: the same replay, another record."""
    layout = SequenceLayout((4,), "float32", length=5, lstm=8)
    replay = PrioritizedReplay(r, keys, layout, 100, seed=0)
    rows = np.zeros(10, layout.dtype)
    rows["steps"] = 5
    replay.insert([row.tobytes() for row in rows], np.ones(10))
    r.hset(keys.replay_data, "2", b"x" * (layout.size - 1))
    r.zadd(keys.replay_priorities, {"2": 1e4, "nope": 1e4})
    for _ in range(20):
        s = replay.sample(8)
        assert b"2" not in s.ids and b"nope" not in s.ids and (s.batch["steps"] == 5).all()
    assert int(r.hget(keys.stats, "rejected:replay")) == 2


def test_sampler_process_survives_bogus_members(r, keys, redis_server):
    """The learner's sampler process drew the bogus member, raised, and the learner exited
    1 (a crash loop under a restart policy: the member stayed)."""
    replay = PrioritizedReplay(r, keys, LAYOUT, 100)
    replay.insert(make_records(range(20)), np.ones(20))
    bogus = plant_bogus(r, keys, LAYOUT)
    spec = SamplerSpec(
        functools.partial(redis.Redis.from_url, redis_server.url),
        keys,
        LAYOUT,
        100,
        "rank",
        0.6,
        0.4,
        batch_size=16,
        learning_starts=1,
        seed=0,
    )
    sampler = Sampler(spec)
    try:
        got = []
        for _ in range(20):
            got.append(sampler.get(timeout=30))
            sampler.release(got[-1].slot)  # its ids stay with it: only the arrays are the slot's
    finally:
        sampler.stop()
    assert all(s is not None and not bogus & set(s.ids) for s in got)
    assert int(r.hget(keys.stats, "rejected:replay")) == len(bogus)


def test_oversized_records_are_rejected_unread(r, keys):
    """A record far beyond the record size is dropped inside Redis, never sent whole."""
    replay = PrioritizedReplay(r, keys, LAYOUT, 100, seed=0)
    replay.insert(make_records(range(10)), np.ones(10))
    r.hset(keys.replay_data, "2", b"x" * 5_000_000)
    r.zadd(keys.replay_priorities, {"2": 1e4})
    for _ in range(5):
        assert b"2" not in replay.sample(8).ids
    (_, entry), *_ = r.xrange(keys.deadletter)
    assert entry[b"source"] == b"replay" and entry[b"size"] == b"0"
