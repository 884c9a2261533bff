"""The frame-stack replay (qrl/replay/frames.py) against a real redis-server, on real
ALE/Pong-v5 frames: what a learner samples is exactly what the env produced, eviction keeps
exactly the chunks still referenced, hostile input is dead-lettered or dropped, and a
transition costs at most 1.5x one LZ4-compressed frame in Redis."""

from __future__ import annotations

import gymnasium as gym
import lz4.block
import numpy as np
import pytest
from hypothesis import given, settings

from qrl.actors.replay import NStep
from qrl.algos.apex.config import ApexConfig
from qrl.algos.apex_family.messages import frames_schema
from qrl.replay import frames as frames_module
from qrl.replay.frames import FrameBatch, FrameLayout, FrameReplay, encode_chunk, pack_frames
from qrl.replay.role import ReplayFiller
from qrl.replay.shards import ShardedReplay
from qrl.rl.envs import make_env
from qrl.runtime.runs import create_run, delete_run
from qrl.wire.codec import decode, encode
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamProducer
from tests import strategies as hs

ENV = "ALE/Pong-v5"
SHAPE = (4, 84, 84)
GAMMA = 0.99


class EndAt(gym.Wrapper):
    """Ends every episode after ``k`` steps, as terminated or truncated."""

    def __init__(self, env: gym.Env, k: int, terminated: bool) -> None:
        super().__init__(env)
        self.k, self.terminated, self.t = k, terminated, 0

    def reset(self, **kw):
        self.t = 0
        return self.env.reset(**kw)

    def step(self, action):
        obs, r, term, trunc, info = self.env.step(action)
        self.t += 1
        if self.t >= self.k:
            term, trunc = term or self.terminated, trunc or not self.terminated
        return obs, r, term, trunc, info


def rollout(ends: list[tuple[int, bool] | None], steps: int, seed: int = 0):
    """Real Pong in a same-step autoreset vector env (as the actors run it), n-step 3 as the
    actor computes it: (obs, action, ret, disc, next_obs, slot) per transition, in the
    order the actor would send them."""

    def make(end):
        return (lambda: make_env(ENV)) if end is None else (lambda: EndAt(make_env(ENV), *end))

    envs = gym.vector.SyncVectorEnv(
        [make(e) for e in ends], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    obs, _ = envs.reset(seed=seed)
    envs.action_space.seed(seed)
    nstep, out = NStep(len(ends), 3, GAMMA), []
    for _ in range(steps):
        act = envs.action_space.sample()
        nxt, rew, term, trunc, info = envs.step(act)
        true_next = nxt.copy()
        for j in np.flatnonzero(term | trunc):
            true_next[j] = info["final_obs"][j]
        done = nstep.add(obs, act, rew, true_next, term, trunc)
        out += [(*t, j) for t, j in zip(done, nstep.slots, strict=True)]
        obs = nxt
    envs.close()
    return out


def message(transitions, batch: str) -> bytes:
    """An ``apex.frames`` payload as the actor builds it."""
    obs, act, ret, disc, nxt, slot = (np.asarray(x) for x in zip(*transitions, strict=True))
    fields = pack_frames(obs, nxt, slot)
    order = fields.pop("order")
    fields.update(
        action=act[order].astype(np.int32),
        ret=ret[order].astype(np.float32),
        disc=disc[order].astype(np.float32),
        priority=np.linspace(0.5, 2.0, len(order), dtype=np.float32),
        version=0,
        actor=0,
        batch=batch,
    )
    return encode("apex.frames", fields), order


def fetch_all(replay: FrameReplay) -> dict[int, np.void]:
    """Every transition present, decoded as the sampler decodes (the sampling script's
    fetch, every rank)."""
    n = replay.size()
    args = ["desc", " ".join(map(str, range(n))), *replay.record_args()]
    _, flat = replay._fetch(keys=replay.sample_keys(), args=args)
    rows = replay.layout.unpack(list(flat[2::3]))
    return {int(i): row for i, row in zip(flat[0::3], rows, strict=True)}


@pytest.fixture(scope="module")
def pong():
    """A rollout of 3 real Pong envs: one terminates every 9 steps, one is truncated every
    13, one plays on."""
    return rollout([(9, True), (13, False), None], 60)


def insert(replay, transitions, size: int) -> list:
    """Insert in actor-sized batches through the wire codec; the transitions by id."""
    by_id = []
    for s in range(0, len(transitions), size):
        part = transitions[s : s + size]
        payload, order = message(part, f"b{s}")
        d = decode(payload, frames_schema(SHAPE, 6))
        assert replay.insert(FrameBatch.of(d), d["priority"], batch_id=d["batch"]) >= 0
        by_id += [part[k] for k in order]
    return by_id


def test_sampled_stacks_equal_the_envs(r, keys, pong):
    kinds = {"terminal": 0, "truncated": 0, "reset padding": 0}
    for o, _, _, disc, _, _ in pong:
        kinds["terminal"] += disc == 0
        kinds["reset padding"] += all((o[k] == o[0]).all() for k in range(4))
    kinds["truncated"] = sum(
        d > GAMMA**3 + 1e-6 for _, _, _, d, _, _ in pong
    )  # bootstraps after fewer than 3 steps: an episode ended by truncation
    assert min(kinds.values()) > 0, kinds
    replay = FrameReplay(r, keys, FrameLayout(SHAPE, "uint8", 6), 10_000, seed=0)
    by_id = insert(replay, pong, 40)
    got = fetch_all(replay)
    assert sorted(got) == list(range(len(pong)))
    for i, (o, a, ret, disc, nxt, _) in enumerate(by_id):
        row = got[i]
        assert row["ok"]
        np.testing.assert_array_equal(row["obs"], o)
        np.testing.assert_array_equal(row["next_obs"], nxt)
        assert (row["action"], row["disc"]) == (a, np.float32(disc))
        assert row["ret"] == pytest.approx(ret, rel=1e-6)
    for _ in range(20):  # and through the sampler's own path
        s = replay.sample(16)
        for i, row in zip(s.ids, s.batch, strict=True):
            np.testing.assert_array_equal(row["obs"], by_id[int(i)][0])
            np.testing.assert_array_equal(row["next_obs"], by_id[int(i)][4])
    stored = sum(len(replay.layout.chunk_frames(c)) for c in r.hvals(keys.replay_frames))
    assert stored < 1.5 * len(pong)  # not 8 frames per transition


def synthetic(n_slots: int, steps: int, rng) -> list:
    """Transitions over small distinct frames (4 x 6 x 6), per slot in time order."""
    out = []
    for t in range(steps):
        for j in range(n_slots):
            f = [
                np.full((6, 6), (t + k) * 7 + j, np.uint8)
                + np.arange(36, dtype=np.uint8).reshape(6, 6) * (j + 1)
                for k in range(7)
            ]
            out.append((np.stack(f[:4]), int(rng.integers(6)), 1.0, GAMMA**3, np.stack(f[3:]), j))
    return out


@pytest.mark.slow
@settings(hs.HOSTILE, max_examples=max(1, hs.HOSTILE.max_examples // 4))  # Redis per example
@given(msg=hs.frames())
def test_any_admitted_chunks_round_trip(r, msg):
    """Whatever ``frames_schema`` admits goes in, and every transition comes out as the
    stacks its references name (a replay that evicts as it goes)."""
    layout = FrameLayout((4, 6, 6), "uint8", 6)
    replay = FrameReplay(r, RunKeys("hostile-frames"), layout, 100, seed=0)
    d = decode(encode("apex.frames", msg), frames_schema((4, 6, 6), 6))
    first = replay.stats()["inserted"]
    replay.insert(FrameBatch.of(d), d["priority"], batch_id=d["batch"] + str(first))
    got = fetch_all(replay)
    end = first + len(d["refs"])
    # exactly the newest 100 transitions (this example's and earlier ones'), none missing
    assert sorted(got) == list(range(max(0, end - 100), end))
    starts = np.repeat(np.cumsum(d["counts"][:, 1]) - d["counts"][:, 1], d["counts"][:, 0])
    for k in range(max(0, len(d["refs"]) - 100), len(d["refs"])):
        row, stack = got[first + k], d["frames"][starts[k] + d["refs"][k].astype(int)]
        assert row["ok"] and (row["obs"] == stack[:4]).all()
        assert (row["next_obs"] == stack[4:]).all() and row["ret"] == d["ret"][k]
    assert all(row["ok"] for row in got.values())


def test_long_runs_of_one_slot_are_split_into_chunks(r, keys, monkeypatch):
    monkeypatch.setattr(frames_module, "CHUNK_MAX", 5)
    part = synthetic(2, 12, np.random.default_rng(3))
    payload, order = message(part, "long")
    d = decode(payload, frames_schema((4, 6, 6), 6))
    assert d["counts"][:, 0].tolist() == [5, 5, 2, 5, 5, 2]
    replay = FrameReplay(r, keys, FrameLayout((4, 6, 6), "uint8", 6), 100, seed=0)
    replay.insert(FrameBatch.of(d), d["priority"], batch_id="long")
    for i, row in fetch_all(replay).items():
        np.testing.assert_array_equal(row["obs"], part[order[i]][0])
        np.testing.assert_array_equal(row["next_obs"], part[order[i]][4])


def test_eviction_keeps_exactly_the_chunks_still_referenced(r, keys):
    rng = np.random.default_rng(1)
    layout = FrameLayout((4, 6, 6), "uint8", 6)
    replay = FrameReplay(r, keys, layout, 50, seed=0)
    by_id, starts = [], []  # starts: (first id, transitions) of every chunk inserted
    for b in range(12):
        part = synthetic(int(rng.integers(1, 4)), int(rng.integers(1, 12)), rng)
        payload, order = message(part, f"e{b}")
        d = decode(payload, frames_schema((4, 6, 6), 6))
        first = len(by_id)
        replay.insert(FrameBatch.of(d), d["priority"], batch_id=d["batch"])
        by_id += [part[k] for k in order]
        for m, _ in d["counts"].tolist():
            starts.append((first, m))
            first += m
        lo = max(0, len(by_id) - 50)
        live = {s for s, m in starts if s + m > lo}
        assert {int(k) for k in r.hkeys(keys.replay_frames)} == live
        got = fetch_all(replay)
        assert sorted(got) == list(range(lo, len(by_id)))
        for i, row in got.items():
            assert row["ok"]
            np.testing.assert_array_equal(row["obs"], by_id[i][0])
            np.testing.assert_array_equal(row["next_obs"], by_id[i][4])


def test_hostile_chunks_are_dead_lettered(r, keys, pong):
    cfg = ApexConfig(env=ENV, actor_batch=64, envs_per_actor=3)
    create_run(r, keys, "apex", cfg)
    filler = ReplayFiller(r, keys, cfg)
    good, _ = message(pong[:30], "good")
    d = decode(good, frames_schema(SHAPE, 6))

    def variant(**change) -> bytes:
        fields = {k: v for k, v in d.items()}
        fields.update(change, batch="bad")
        return encode("apex.frames", fields)

    refs = d["refs"].copy()
    refs[0, 0] = d["counts"][0, 1]  # one past its chunk's frames
    counts = d["counts"].copy()
    counts[0, 1] += 1
    corrupt = bytearray(good)
    corrupt[len(corrupt) // 2 : len(corrupt) // 2 + 64] = bytes(64)
    hostile = [
        variant(refs=refs),
        variant(counts=counts),
        variant(frames=np.ascontiguousarray(d["frames"][:, :, :80])),
        variant(frames=d["frames"].astype(np.uint16)),
        variant(refs=d["refs"][:, :7].copy()),
        variant(counts=np.zeros((0, 2), np.int32)),
        bytes(corrupt),
        good[: len(good) // 2],
    ]
    producer = StreamProducer(r, keys.experience, maxlen=100, keys=keys)
    for p in [*hostile, good]:
        producer.add(p)
    while r.xlen(keys.experience):
        filler.step(lambda: False)
    assert filler.consumer.rejected == len(hostile)
    assert r.xlen(keys.deadletter) == len(hostile)
    assert filler.replay.size() == 30 and filler.inserted == 30


def test_corrupt_or_missing_chunks_are_dropped_removed_and_counted(r, keys, pong):
    layout = FrameLayout(SHAPE, "uint8", 6)
    replay = FrameReplay(r, keys, layout, 10_000, seed=0)
    by_id = insert(replay, pong, 60)
    chunks = {int(k): v for k, v in r.hgetall(keys.replay_frames).items()}
    starts = sorted(chunks)
    flipped = bytearray(chunks[starts[0]])
    flipped[-20] ^= 0xFF  # inside the last LZ4 block: caught by its CRC
    recs0, _, g, blocks0 = layout.parse(chunks[starts[0]])
    last = len(blocks0) - 1  # the transitions that need it are dropped; the rest are not
    flipped_out = {starts[0] + i for i, r in enumerate(recs0) if last in r["refs"] // g}
    kept = set(range(starts[0], starts[1])) - flipped_out
    assert flipped_out and kept
    recs, f, _, _ = layout.parse(chunks[starts[1]])
    bad_refs = recs.copy()
    bad_refs["refs"][0, 0] = f  # beyond the chunk's frames, with a valid CRC
    bad_action = recs.copy()
    bad_action["action"][:] = 99
    frames = layout.chunk_frames(chunks[starts[1]])
    r.hset(keys.replay_frames, starts[0], bytes(flipped))
    r.hset(keys.replay_frames, starts[1], encode_chunk(frames, bad_refs))
    r.hset(keys.replay_frames, starts[2], encode_chunk(frames, bad_action))
    r.hset(keys.replay_frames, starts[3], chunks[starts[3]][:30])
    r.hdel(keys.replay_frames, starts[4])
    bad = {i for k in (2, 3, 4) for i in range(starts[k], starts[k + 1])} | {starts[1]}
    bad |= flipped_out
    seen = set()
    for _ in range(200):
        s = replay.sample(32)
        if s is None:
            continue
        seen |= {int(i) for i in s.ids}
        assert not bad & {int(i) for i in s.ids}
        assert s.batch["ok"].all() and s.weights.max() == 1
        for i, row in zip(s.ids, s.batch, strict=True):
            np.testing.assert_array_equal(row["obs"], by_id[int(i)][0])
    assert kept & seen
    present = {int(m) for m in r.zrange(keys.replay_priorities, 0, -1)}
    removed = bad - present
    assert removed and present | removed == set(range(len(by_id)))
    assert int(r.hget(keys.stats, "rejected:replay")) == len(removed)
    assert r.xlen(keys.deadletter) == len(removed)


def test_ring_entries_out_of_range_fetch_no_chunk(r, keys, pong):
    """A transition's ring entry (how far back its chunk's first transition is) that points
    before id 0 (the top bit set, too), to an id where no chunk starts, or lies past the end
    of a ring cut short fetches no chunk: those transitions are dropped, every other one
    samples as stored."""
    replay = FrameReplay(r, keys, FrameLayout(SHAPE, "uint8", 6), 10_000, seed=0)
    by_id = insert(replay, pong, 60)
    starts = sorted(int(k) for k in r.hkeys(keys.replay_frames))
    ring = bytearray(r.get(keys.replay_index))
    assert len(ring) == 4 * len(by_id)
    mid = starts[1] + 1  # not a chunk's first transition
    bad = {1: 0xFFFFFFFF, 5: 6, mid: 1 + int.from_bytes(ring[4 * mid : 4 * mid + 4], "little")}
    for i, rel in bad.items():
        ring[4 * i : 4 * i + 4] = rel.to_bytes(4, "little")
    r.set(keys.replay_index, bytes(ring[: 4 * (len(by_id) - 3)]))
    dropped = set(bad) | set(range(len(by_id) - 3, len(by_id)))
    seen = set()
    for _ in range(100):
        s = replay.sample(32)
        if s is None:
            continue
        got = {int(i) for i in s.ids}
        assert not got & dropped and s.batch["ok"].all()
        for i, row in zip(s.ids, s.batch, strict=True):
            np.testing.assert_array_equal(row["next_obs"], by_id[int(i)][4])
        seen |= got
    assert seen == set(range(len(by_id))) - dropped


@pytest.mark.slow
def test_a_pong_transition_costs_at_most_1_5_frames(r, keys):
    """8 envs, batches of 256 as the actor sends them by default; the replay full."""
    transitions = rollout([None] * 8, 260, seed=3)[:2048]
    replay = FrameReplay(r, keys, FrameLayout(SHAPE, "uint8", 6), 2048, seed=0)
    insert(replay, transitions, 256)
    names = [keys.replay_priorities, keys.replay_frames, keys.replay_index, keys.replay_meta]
    held = sum(r.memory_usage(k, samples=0) for k in [*names, keys.replay_batches])
    frames = {o[-1].tobytes() for o, *_ in transitions}
    frame = np.mean([len(lz4.block.compress(f, store_size=False)) for f in frames])
    assert 150 < frame < 400  # a Pong frame, not a blank one
    assert held / len(transitions) <= 1.5 * frame, (held / len(transitions), frame)


def test_frame_replay_through_a_cluster_client(redis_cluster):
    """Every script's keys share the run's hash tag: the frame replay works through a
    cluster client connected to any node."""
    client = connect(redis_cluster.urls[0])
    keys = RunKeys("frames-cluster")
    replay = FrameReplay(client, keys, FrameLayout((4, 6, 6), "uint8", 6), 30, seed=0)
    rng = np.random.default_rng(2)
    by_id = []
    for b in range(4):
        part = synthetic(2, 8, rng)
        payload, order = message(part, f"c{b}")
        d = decode(payload, frames_schema((4, 6, 6), 6))
        replay.insert(FrameBatch.of(d), d["priority"], batch_id=d["batch"])
        by_id += [part[k] for k in order]
    s = replay.sample(16)
    assert len(s.ids) == 16 and min(int(i) for i in s.ids) >= len(by_id) - 30
    for i, row in zip(s.ids, s.batch, strict=True):
        np.testing.assert_array_equal(row["next_obs"], by_id[int(i)][4])
    replay.update_priorities(s.ids, np.full(16, 3.0))
    delete_run(client, keys)
    client.close()


def test_sharded_frame_replay_samples_across_shards_and_drops_corrupt_chunks(r, keys):
    """Each shard is a frame replay of its own; a batch drawn across them carries
    ``shard:id`` ids, and a corrupt chunk in one shard is dropped there."""
    replay = ShardedReplay(r, keys, FrameLayout((4, 6, 6), "uint8", 6), 200, shards=2, seed=0)
    rng = np.random.default_rng(4)
    by_id: list[list] = [[], []]
    for s, part in enumerate(replay.parts):
        for b in range(3):
            rows = synthetic(2, 6, rng)
            payload, order = message(rows, f"s{s}b{b}")
            d = decode(payload, frames_schema((4, 6, 6), 6))
            part.insert(FrameBatch.of(d), d["priority"], batch_id=d["batch"])
            by_id[s] += [rows[k] for k in order]
    shard1 = replay.parts[1].keys
    first = min(int(k) for k in r.hkeys(shard1.replay_frames))
    r.hset(shard1.replay_frames, first, b"garbage")
    seen = set()
    for _ in range(50):
        sample = replay.sample(16)
        for i, row in zip(sample.ids, sample.batch, strict=True):
            s, _, local = i.partition(b":")
            seen.add(int(s))
            assert not (int(s) == 1 and first <= int(local) < first + 6)  # its 6 transitions
            np.testing.assert_array_equal(row["obs"], by_id[int(s)][int(local)][0])
    assert seen == {0, 1}
    assert r.zscore(shard1.replay_priorities, first) is None  # removed where it was drawn
    assert int(r.hget(shard1.stats, "rejected:replay")) >= 1
