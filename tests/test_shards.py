"""The sharded replay (qrl/replay/shards.py, ``replay_shards``) against a real redis-server:
its key layout, sampling across shards against one replay's distribution (chi-square),
priority updates to the owning shard, the actors' routing and the fillers, ``qrl status``
and ``qrl run delete``, the progress of ``qrl train``. Whole jobs: tests/test_shards_jobs.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from qrl.algos import ALGOS
from qrl.algos.apex.config import ApexConfig
from qrl.jobs.acl import run_rule
from qrl.replay.role import ReplayFiller, make_replay
from qrl.replay.shards import ShardedReplay, shard_of_slots
from qrl.replay.store import BUCKETS_PER_OCTAVE, P_LO, PrioritizedReplay
from qrl.runtime.roles import REPLAY_SIZE
from qrl.runtime.runlog import Progress
from qrl.runtime.runs import create_run, delete_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys
from qrl.wire.streams import ensure_group
from qrl.wire.weights import WeightStore
from tests.cli import qrl
from tests.helpers import (
    LAYOUT,
    bucket_of,
    check_records,
    chi2_critical,
    chi2_stat,
    make_actor,
    make_records,
    make_runner,
)

ALPHA, BATCH, BATCHES, BETA = 0.6, 64, 500, 0.5
SIZES = (40, 25, 10)  # three shards of unequal size


# -- key layout


def test_one_shard_is_exactly_the_unsharded_layout():
    keys = RunKeys("cartpole")
    assert keys.shards(1) == [keys]
    assert keys.replay_priorities == "qrl:{cartpole}:replay:prio"
    assert keys.experience == "qrl:{cartpole}:experience"


@pytest.mark.parametrize("n", [2, 3, 5, 16])
def test_shard_tags_spread_over_the_slot_ranges(n):
    shards = RunKeys("cartpole").shards(n)
    assert shards == RunKeys("cartpole").shards(n)  # deterministic
    assert len({k.prefix for k in shards}) == n
    width = REDIS_CLUSTER_HASH_SLOTS / n
    for s, k in enumerate(shards):
        assert k.prefix.startswith("qrl:{cartpole~") and k.prefix.endswith("}:")
        # every key of the shard has the shard's slot, in the middle half of range s
        slots = {redis.crc.key_slot(key.encode()) for key in (k.experience, k.replay_data)}
        assert slots == {k.slot()}
        assert (s + 0.25) * width <= k.slot() < (s + 0.75) * width
        assert RunKeys.run_of(k.experience) is None  # not mistaken for a run of its own
    # the standard 3-master split (redis-cli --cluster create): one shard per master
    masters = [range(0, 5461), range(5461, 10923), range(10923, 16384)]
    three = RunKeys("cartpole").shards(3)
    assert [next(i for i, m in enumerate(masters) if k.slot() in m) for k in three] == [0, 1, 2]


def test_run_pattern_and_delete_cover_the_shards_and_nothing_else(r, keys):
    cfg = ApexConfig(replay_shards=3)
    create_run(r, keys, "apex", cfg)
    for s in range(3):
        make_replay(r, keys, cfg, shard=s).insert(make_records([s]), np.ones(1))
    others = [RunKeys(keys.run + "x"), RunKeys(keys.run + "-2"), RunKeys("a" + keys.run)]
    for o in others:
        r.set(o.config, b"keep")
        r.set(o.shards(3)[1].replay_meta, b"keep")
    mine = {k.decode() for k in r.scan_iter(keys.pattern())}
    assert {k.replay_priorities for k in keys.shards(3)} <= mine
    assert keys.config in mine and all(RunKeys.run_of(k) in (keys.run, None) for k in mine)
    assert delete_run(r, keys) == len(mine)
    assert list(r.scan_iter(keys.pattern())) == []
    for o in others:
        assert r.get(o.config) == r.get(o.shards(3)[1].replay_meta) == b"keep"


def test_the_documented_acl_rule_covers_the_shards():
    run = "acl-shards"
    keys = RunKeys(run)
    with EmbeddedRedis(password="admin-pw") as server:
        admin = redis.Redis.from_url(server.url)
        assert f"resetchannels ~{' ~'.join(keys.acl_patterns())} +@all" in run_rule(run)
        make_runner(admin, run, password="pw")  # the per-run rule (docs/many-machines.md)
        runner = redis.Redis.from_url(f"redis://runner:pw@127.0.0.1:{server.port}/0")
        for k in keys.shards(3):
            replay = PrioritizedReplay(runner, k, LAYOUT, 10)
            assert replay.insert(make_records([0]), np.ones(1), batch_id="b") == 0
        # prio, data, meta, batches of each shard; finding them takes SCAN, which the rule
        # leaves out (it would list other runs' key names): `qrl run delete` is the admin's
        assert delete_run(admin, keys) == 3 * 4
        for other in (RunKeys("other"), RunKeys("other").shards(3)[0], RunKeys(run + "x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                runner.set(other.replay_meta, b"x")


# -- sampling across shards


def _fill(r, keys, mode, prio, seed=5) -> tuple[PrioritizedReplay, ShardedReplay, np.ndarray]:
    """The same transitions and priorities in one replay (run ``keys.run``-one) and in three
    shards of unequal size (run ``keys.run``); returns both and each transition's shard."""
    one = PrioritizedReplay(r, RunKeys(keys.run + "-one"), LAYOUT, 1000, mode=mode, alpha=ALPHA)
    one.insert(make_records(range(len(prio))), prio)
    shard = np.random.default_rng(seed).permutation(np.repeat([0, 1, 2], SIZES))
    sharded = ShardedReplay(r, keys, LAYOUT, 3000, shards=3, mode=mode, alpha=ALPHA, seed=seed)
    for s, part in enumerate(sharded.parts):
        ids = np.flatnonzero(shard == s)
        part.insert(make_records(ids), prio[ids], batch_id=f"b{s}")
    return one, sharded, shard


def _draw(sharded: ShardedReplay, n: int, p_expected: np.ndarray) -> np.ndarray:
    """Counts per transition over BATCHES batches, each batch checked: size, records,
    probabilities and IS weights."""
    counts = np.zeros(n, int)
    for _ in range(BATCHES):
        s = sharded.sample(BATCH, beta=BETA)
        assert s is not None and s.size == n and len(s.ids) == BATCH
        got = s.batch["action"].astype(int)
        check_records(s.batch, got)
        np.testing.assert_allclose(s.probs, p_expected[got], rtol=1e-9)
        w = (n * p_expected[got]) ** -BETA
        np.testing.assert_allclose(s.weights, w / w.max(), rtol=1e-6)
        counts += np.bincount(got, minlength=n)
    return counts


def test_proportional_sampling_across_shards_matches_one_replay(r, keys):
    """Three shards of unequal size and mass give every transition the probability one
    replay gives it (exactly: the same numbers), and the draws follow it (chi-square); an
    even split of the batch over the shards would not."""
    rng = np.random.default_rng(3)
    n = sum(SIZES)
    prio = np.exp(rng.uniform(np.log(1e-2), np.log(1.0), n))  # two decades of priority
    one, sharded, shard = _fill(r, keys, "proportional", prio)
    v = np.array([P_LO * 2 ** ((bucket_of(p) + 0.5) / BUCKETS_PER_OCTAVE) for p in prio])
    p_one = v**ALPHA / (v**ALPHA).sum()  # one replay's law (tests/test_replay.py checks it)
    s = one.sample(BATCH, beta=BETA)
    np.testing.assert_allclose(s.probs, p_one[s.batch["action"]], rtol=1e-12)

    counts = _draw(sharded, n, p_one)
    expected = counts.sum() * p_one
    assert expected.min() > 50
    stat = chi2_stat(counts, expected)
    critical = chi2_critical(n - 1)
    assert stat < critical, (stat, critical)
    # the test has teeth: B/3 draws per shard, each shard by its own law, is rejected by far
    mass = np.array([p_one[shard == s].sum() for s in range(3)])
    p_even = p_one / mass[shard] / 3
    assert chi2_stat(counts, counts.sum() * p_even) > 10 * critical


def test_rank_sampling_across_shards_follows_the_documented_approximation(r, keys):
    """Rank mode: shard s gets the share n_s / N of each batch and ranks within itself, as
    qrl/replay/shards.py documents; the draws follow that law (chi-square), and the law is
    close to one replay's global rank law (total variation, measured at a realistic size)."""
    rng = np.random.default_rng(4)
    n = sum(SIZES)
    prio = rng.permutation(n) + 1.0  # distinct
    _, sharded, shard = _fill(r, keys, "rank", prio)
    p_doc = _rank_law(prio, shard, np.array(SIZES))
    counts = _draw(sharded, n, p_doc)
    expected = counts.sum() * p_doc
    assert expected.min() > 20
    stat = chi2_stat(counts, expected)
    critical = chi2_critical(n - 1)
    assert stat < critical, (stat, critical)
    p_global = _rank_law(prio, np.zeros(n, int), np.array([n]))
    assert chi2_stat(counts, counts.sum() * p_global) > critical  # the gap shows at N = 75...
    # ...and shrinks with size: 3 even shards of 30,000 like priorities, total variation
    big = 90_000
    prio = rng.random(big)
    shard = rng.permutation(np.arange(big) % 3)
    tv = (
        0.5
        * np.abs(
            _rank_law(prio, shard, np.full(3, big // 3))
            - _rank_law(prio, 0 * shard, np.array([big]))
        ).sum()
    )
    assert tv < 0.02, tv


def _rank_law(prio: np.ndarray, shard: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """P(i) = n_s / N x r_s(i)^-a / sum_{r <= n_s} r^-a, r_s(i) = i's rank in its shard."""
    p = np.empty(len(prio))
    for s, n_s in enumerate(sizes):
        idx = np.flatnonzero(shard == s)
        rank = np.empty(len(idx))
        rank[np.argsort(-prio[idx])] = np.arange(1, len(idx) + 1)
        p[idx] = n_s / sizes.sum() * rank**-ALPHA / (np.arange(1, n_s + 1) ** -ALPHA).sum()
    return p


def test_priority_updates_go_to_the_owning_shard(r, keys):
    prio = np.full(sum(SIZES), 0.5)
    _, sharded, shard = _fill(r, keys, "proportional", prio)
    s = sharded.sample(BATCH, beta=BETA)
    got = s.batch["action"].astype(int)
    new = 1.0 + np.arange(BATCH) / 8
    sharded.update_priorities(s.ids, new)
    for i, t in zip(s.ids, got, strict=True):
        part, local = i.split(b":")
        assert int(part) == shard[t]
        k = sharded.parts[shard[t]].keys
        assert (
            sharded.parts[shard[t]].layout.unpack([r.hget(k.replay_data, local)])["action"][0] == t
        )
    for t in range(sum(SIZES)):  # exactly the sampled ones changed (the last update wins)
        k = sharded.parts[shard[t]].keys
        local = [
            m
            for m in r.zrange(k.replay_priorities, 0, -1)
            if int(LAYOUT.unpack([r.hget(k.replay_data, m)])["action"][0]) == t
        ]
        want = new[got == t][-1] if t in got else 0.5
        assert r.zscore(k.replay_priorities, local[0]) == pytest.approx(want)
    assert sharded.size() == sum(SIZES)


def test_a_shard_whose_priorities_a_writer_replaced_does_not_stop_the_others(r, keys):
    """Every shard's ZADD XX goes in one pipeline: a shard whose priorities key a writer made
    a string is skipped (its next insert repairs the key); the other shards' updates land."""
    _, sharded, _ = _fill(r, keys, "proportional", np.full(sum(SIZES), 0.5))
    s = sharded.sample(BATCH, beta=BETA)
    assert {int(i.split(b":")[0]) for i in s.ids} == {0, 1, 2}
    bad = sharded.parts[1].keys.replay_priorities
    r.delete(bad)
    r.set(bad, b"junk")
    sharded.update_priorities(s.ids, np.full(BATCH, 2.0))
    for i in s.ids:
        part, local = i.split(b":")
        if int(part) != 1:
            assert r.zscore(sharded.parts[int(part)].keys.replay_priorities, local) == 2.0
    assert r.get(bad) == b"junk"


@pytest.mark.parametrize("mode", ["rank", "proportional"])
def test_shards_draw_in_one_pipeline_even_after_redis_forgot_the_scripts(r, keys, mode):
    """The shards' sampling scripts go as EVALSHA in one pipeline; after SCRIPT FLUSH (a
    restarted or failed-over node holds no scripts) each runs again through its Script."""
    prio = np.full(sum(SIZES), 0.5)
    _, sharded, shard = _fill(r, keys, mode, prio)
    for flush in (False, True, False):
        if flush:
            r.script_flush()
        s = sharded.sample(BATCH, beta=BETA)
        assert s is not None and len(s.ids) == BATCH
        got = s.batch["action"].astype(int)
        check_records(s.batch, got)
        assert [int(i.split(b":")[0]) for i in s.ids] == shard[got].tolist()


# -- actors and fillers


def test_actors_route_env_slots_to_shards_and_fillers_drain_each_shard(r, keys):
    """Env slot g goes to shard g mod 3, each shard's batches to its own stream; fillers
    0-2 (and 4, a second one for shard 1) drain each shard into its replay, every batch
    exactly once."""
    assert shard_of_slots(0, 6, 3).tolist() == [0, 1, 2, 0, 1, 2]
    assert shard_of_slots(1, 2, 3).tolist() == [2, 0]
    cfg = ApexConfig(
        actors=1,
        envs_per_actor=6,
        replay_shards=3,
        n_step=1,
        actor_batch=60,
        steps_per_update=0,
        replay_capacity=3000,
    )
    create_run(r, keys, "apex", cfg)
    actor = make_actor("apex", r, keys, cfg)
    WeightStore(r, keys).publish(actor.weights.net, 0)
    assert actor.start(lambda: False)
    for _ in range(100):
        assert actor.step(lambda: False)
    actor.close(lambda: False)
    assert actor.steps == 600 and not r.exists(keys.experience)  # no unsharded stream
    shards = keys.shards(3)
    fillers = [ReplayFiller(r, keys, cfg, ident) for ident in (0, 1, 2, 4)]
    assert [f.shard for f in fillers] == [0, 1, 2, 1]
    for f in fillers:
        while f.consumer.process(f.handle, block_ms=10):
            pass
        f.close(lambda: False)
    rows = []
    for k in shards:
        produced = int(r.hget(k.stats, "produced:experience"))
        assert produced >= 10 and r.xlen(k.experience) == 0
        assert int(r.hget(k.replay_meta, "batches")) == r.zcard(k.replay_batches) == produced
        ids = r.zrange(k.replay_priorities, 0, -1)
        rows.append(LAYOUT.unpack(r.hmget(k.replay_data, ids)))
    assert [len(x) for x in rows] == [200, 200, 200]  # 2 env slots x 100 steps each (n=1)
    # an env slot's transitions stay in its shard: each observation that follows another
    # (all but the episodes' first) is the next observation of a transition of that shard
    for s, x in enumerate(rows):
        nxt = {o.tobytes() for o in x["next_obs"]}
        other = {o.tobytes() for t, y in enumerate(rows) if t != s for o in y["next_obs"]}
        followed = sum(o.tobytes() in nxt for o in x["obs"])
        assert followed >= len(x) - 2 * (1 + (x["disc"] == 0).sum())  # resets only
        assert not any(o.tobytes() in other for o in x["obs"])


def test_status_shows_the_shards_and_run_delete_removes_them(r, keys, redis_server):
    cfg = ApexConfig(replay_shards=3)
    create_run(r, keys, "apex", cfg)
    for s, n in enumerate((5, 7, 0)):
        make_replay(r, keys, cfg, shard=s).insert(make_records(range(n)), np.ones(n))
    r.xadd(keys.shards(3)[2].deadletter, {"reason": "test"})
    for k in keys.shards(3):
        ensure_group(r, k.experience)  # as each shard's filler does
    out = qrl("status", "--run", keys.run, "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["replay_size"] == 12 and status["replay_shards"] == 3
    assert status["shard_dead_letters"] == 1
    assert sorted(status["streams"]) == ["experience.0", "experience.1", "experience.2"]
    text = qrl("status", "--run", keys.run)
    assert text.returncode == 0 and "replay shards 3" in text.stdout, text.stdout
    gone = qrl("run", "delete", keys.run, "--yes")
    assert gone.returncode == 0, gone.stderr
    assert list(r.scan_iter(keys.pattern())) == []


def test_progress_sums_the_fillers_shard_sizes():
    """``qrl train``'s progress (metrics.csv): the replay size is the sum over shards of the
    latest size a filler of each reported, two fillers of one shard counted once."""
    progress = Progress(ALGOS["apex"].reports)
    for ident, shard, size in [(0, 0, 100), (1, 1, 80), (2, 2, 60), (3, 0, 110), (1, 1, 90)]:
        progress.fold({"role": "replay", "id": ident, "values": {"size": size, "shard": shard}})
    assert progress.value(REPLAY_SIZE) == 110 + 90 + 60
    progress.fold({"role": "replay", "id": 9, "values": {"size": 5, "shard": 10**6}})  # no shard
    (fold,) = progress.folds["replay"]
    assert progress.value(REPLAY_SIZE) == 260 and len(fold.latest) == 3
    one = Progress(ALGOS["apex"].reports)  # an unsharded run's fillers send no shard: all 0
    for ident, size in [(0, 10), (1, 12)]:
        one.fold({"role": "replay", "id": ident, "values": {"size": size}})
    assert one.value(REPLAY_SIZE) == 12
