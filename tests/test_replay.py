"""The prioritized replay (qrl/replay/store.py) against a real redis-server.

The sampling distributions are checked with chi-square goodness-of-fit tests over many
stratified batches. Stratification makes the counts *less* variable than multinomial draws,
so the multinomial critical value is conservative: a correct sampler passes it with room to
spare, and a wrong one (see ``test_chi_square_rejects_a_wrong_distribution``) fails it by far.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from qrl.replay.store import (
    BUCKETS_PER_OCTAVE,
    N_BUCKETS,
    P_HI,
    P_LO,
    PrioritizedReplay,
    RecordLayout,
)
from tests.helpers import (
    LAYOUT,
    bucket_of,
    check_records,
    chi2_critical,
    chi2_stat,
    int_ids,
    make_records,
)


def test_chi2_critical_matches_tables():
    # chi-square tables: 0.999 quantiles for df 10 and 39, 0.99 for df 5
    assert chi2_critical(10) == pytest.approx(29.588, rel=1e-2)
    assert chi2_critical(39) == pytest.approx(72.055, rel=1e-2)
    assert chi2_critical(5, 0.01) == pytest.approx(15.086, rel=1e-2)


def members(r, key) -> list[int]:
    return sorted(int(m) for m in r.zrange(key, 0, -1))


# -- rank mode

RANK_N, RANK_ALPHA, RANK_BATCH, RANK_BATCHES, BETA = 40, 0.7, 64, 1000, 0.5


def rank_draws(r, keys) -> tuple[np.ndarray, np.ndarray]:
    """Sample RANK_BATCHES stratified batches from RANK_N transitions of distinct
    priorities, checking every batch on the way; returns counts by rank (0-based) and the
    documented P(rank)."""
    rng = np.random.default_rng(7)
    prio = (rng.permutation(RANK_N) + 1) * 0.37  # distinct, ids not in priority order
    replay = PrioritizedReplay(r, keys, LAYOUT, 1000, alpha=RANK_ALPHA, seed=11)
    assert replay.insert(make_records(range(RANK_N)), prio) == 0
    rank_of = np.empty(RANK_N, int)
    rank_of[np.argsort(-prio)] = np.arange(RANK_N)  # rank 0 = highest priority
    assert int_ids(r.zrevrange(keys.replay_priorities, 0, -1)).tolist() == list(np.argsort(-prio))

    w = np.arange(1, RANK_N + 1, dtype=np.float64) ** -RANK_ALPHA
    p_rank = w / w.sum()
    cdf = np.cumsum(p_rank)
    counts = np.zeros(RANK_N, int)
    for _ in range(RANK_BATCHES):
        s = replay.sample(RANK_BATCH, beta=BETA)
        assert s is not None and s.size == RANK_N and len(s.ids) == RANK_BATCH
        ranks = rank_of[int_ids(s.ids)]
        np.testing.assert_allclose(s.probs, p_rank[ranks], rtol=1e-12)
        expected_w = (RANK_N * p_rank[ranks]) ** -BETA
        np.testing.assert_allclose(s.weights, expected_w / expected_w.max(), rtol=1e-6)
        assert s.weights.dtype == np.float32 and s.weights.max() == 1.0
        check_records(s.batch, int_ids(s.ids))
        # stratified: draw j lies in the j-th of RANK_BATCH equal-mass segments of the CDF
        j = np.arange(RANK_BATCH)
        below = np.where(ranks > 0, cdf[ranks - 1], 0.0)
        assert np.all(below <= (j + 1) / RANK_BATCH + 1e-12)
        assert np.all(cdf[ranks] >= j / RANK_BATCH - 1e-12)
        counts += np.bincount(ranks, minlength=RANK_N)
    return counts, p_rank


def test_rank_sampling_follows_power_law(r, keys):
    counts, p_rank = rank_draws(r, keys)
    expected = counts.sum() * p_rank
    assert expected.min() > 50
    stat = chi2_stat(counts, expected)
    assert stat < chi2_critical(RANK_N - 1), (stat, counts, expected)
    np.testing.assert_allclose(
        PrioritizedReplay(r, keys, LAYOUT, 1000, alpha=RANK_ALPHA).rank_probabilities(RANK_N),
        p_rank,
        rtol=1e-12,
    )


def test_chi_square_rejects_a_wrong_distribution(r, keys):
    """The same statistic, fed the rank sampler's counts but a wrong model, is far beyond
    the critical value: uniform sampling by ~800x, the right law with alpha off by only 0.05
    by ~3x (~10 is typical for the right model, with 39 degrees of freedom)."""
    counts, _ = rank_draws(r, keys)
    critical = chi2_critical(RANK_N - 1)
    uniform = np.full(RANK_N, counts.sum() / RANK_N)
    assert chi2_stat(counts, uniform) > 100 * critical
    w = np.arange(1, RANK_N + 1, dtype=np.float64) ** -(RANK_ALPHA - 0.05)
    assert chi2_stat(counts, counts.sum() * w / w.sum()) > 2 * critical


# -- proportional mode

PROP_ALPHA, PROP_BATCH, PROP_BATCHES = 0.6, 64, 1000
# bucket k spans [P_LO 2^(k/4), P_LO 2^((k+1)/4)); these run from ~1e-3 to ~1 with empty
# buckets between them, and hold 1 to 6 transitions each
PROP_BUCKETS = {40: 5, 41: 3, 45: 4, 52: 6, 53: 1, 60: 4, 66: 3, 75: 5, 80: 2}


def test_proportional_sampling_follows_bucketed_priorities(r, keys):
    rng = np.random.default_rng(3)
    # priorities well inside their bucket (away from the edges), in random id order
    prio = np.array(
        [
            P_LO * 2 ** ((k + f) / BUCKETS_PER_OCTAVE)
            for k, n in PROP_BUCKETS.items()
            for f in rng.uniform(0.1, 0.9, n)
        ]
    )
    prio = rng.permutation(prio)
    n = len(prio)
    assert sorted(bucket_of(p) for p in prio) == sorted(
        k for k, c in PROP_BUCKETS.items() for _ in range(c)
    )
    # documented: P(i) = v_k(i)^a / sum_k n_k v_k^a, v_k the bucket's geometric mid-point
    v = np.array([P_LO * 2 ** ((bucket_of(p) + 0.5) / BUCKETS_PER_OCTAVE) for p in prio])
    p_expected = v**PROP_ALPHA / (v**PROP_ALPHA).sum()

    replay = PrioritizedReplay(r, keys, LAYOUT, 1000, mode="proportional", alpha=PROP_ALPHA, seed=5)
    replay.insert(make_records(range(n)), prio)
    counts = np.zeros(n, int)
    for _ in range(PROP_BATCHES):
        s = replay.sample(PROP_BATCH, beta=BETA)
        assert s is not None and s.size == n and len(s.ids) == PROP_BATCH
        ids = int_ids(s.ids)
        np.testing.assert_allclose(s.probs, p_expected[ids], rtol=1e-12)
        w = (n * p_expected[ids]) ** -BETA
        np.testing.assert_allclose(s.weights, w / w.max(), rtol=1e-6)
        check_records(s.batch, ids)
        counts += np.bincount(ids, minlength=n)
    expected = counts.sum() * p_expected
    assert expected.min() > 50
    stat = chi2_stat(counts, expected)
    assert stat < chi2_critical(n - 1), (stat, counts, expected)
    # and the quantization keeps P within +-9% per unit of alpha of p^a / sum p^a
    exact = prio**PROP_ALPHA / (prio**PROP_ALPHA).sum()
    ratio = p_expected / exact
    assert ratio.max() / ratio.min() < 2 ** (PROP_ALPHA / BUCKETS_PER_OCTAVE)


def test_proportional_priorities_on_bucket_edges(r, keys):
    """A priority exactly on a bucket edge, or a hair either side of it, belongs to exactly
    one bucket: the bucket counts add up to the size and every transition is drawn with its
    own bucket's probability."""
    ratio = 2 ** (1 / BUCKETS_PER_OCTAVE)
    # the edges as the script computes them, in full precision
    edges = [
        float(e)
        for e in r.eval(
            "local t = {} for b = 0, tonumber(ARGV[3]) do "
            "t[#t + 1] = string.format('%.17g', tonumber(ARGV[1]) * tonumber(ARGV[2]) ^ b) "
            "end return t",
            0,
            P_LO,
            ratio,
            N_BUCKETS,
        )
    ]
    prio = []
    for b in (31, 47, 58, 64, 70, 77, 83, 90):
        e = edges[b]
        prio += [e, float(f"{e:.14g}"), math.nextafter(e, 0), math.nextafter(e, math.inf)]
    prio = np.array(prio)
    k = np.searchsorted(edges, prio, side="right") - 1  # edges[k] <= p < edges[k + 1]
    v = P_LO * ratio ** (k + 0.5)
    p_expected = v**0.5 / (v**0.5).sum()

    n = len(prio)
    replay = PrioritizedReplay(r, keys, LAYOUT, 1000, mode="proportional", alpha=0.5, seed=2)
    replay.insert(make_records(range(n)), prio)
    assert r.zscore(keys.replay_priorities, "0") == prio[0]  # stored exactly
    counts = np.zeros(n, int)
    for _ in range(100):
        s = replay.sample(64)
        assert s.size == n and len(s.ids) == 64
        ids = int_ids(s.ids)
        np.testing.assert_allclose(s.probs, p_expected[ids], rtol=1e-9)
        counts += np.bincount(ids, minlength=n)
    assert counts.min() > 0
    assert chi2_stat(counts, counts.sum() * p_expected) < chi2_critical(n - 1)


def test_priorities_are_clipped(r, keys):
    replay = PrioritizedReplay(r, keys, LAYOUT, 100)
    replay.insert(make_records(range(6)), np.array([0.0, -1.0, np.nan, np.inf, 1e9, 0.5]))
    scores = [r.zscore(keys.replay_priorities, str(i)) for i in range(6)]
    assert scores == [P_LO, P_LO, P_HI, P_HI, P_HI, 0.5]
    replay.update_priorities([b"5", b"0"], np.array([np.nan, 1e-12]))
    assert r.zscore(keys.replay_priorities, "5") == P_HI
    assert r.zscore(keys.replay_priorities, "0") == P_LO


def test_empty_replay_samples_none(r, keys):
    for mode in ("rank", "proportional"):
        replay = PrioritizedReplay(r, keys, LAYOUT, 100, mode=mode)
        assert replay.sample(8) is None
    with pytest.raises(ValueError, match="mode"):
        PrioritizedReplay(r, keys, LAYOUT, 100, mode="uniform")  # type: ignore[arg-type]


# -- insert, eviction, idempotence


def test_eviction_is_fifo_regardless_of_priority(r, keys):
    cap = 100
    replay = PrioritizedReplay(r, keys, LAYOUT, cap, seed=0)
    evicted, start = [], 0
    for size in (30, 30, 30, 30, 25):
        ids = np.arange(start, start + size)
        evicted.append(replay.insert(make_records(ids), 1000.0 - ids))  # oldest: highest
        start += size
    assert evicted == [0, 0, 0, 20, 25]
    assert replay.stats() == {"size": cap, "inserted": 145, "evicted": 45, "batches": 0}
    remaining = list(range(45, 145))
    assert members(r, keys.replay_priorities) == remaining
    assert sorted(int(f) for f in r.hkeys(keys.replay_data)) == remaining
    check_records(LAYOUT.unpack(r.hmget(keys.replay_data, remaining)), remaining)
    # the sampler only ever sees what is left, highest priority (oldest left) first
    s = replay.sample(32)
    assert s.size == cap and int_ids(s.ids).min() >= 45
    assert r.zrevrange(keys.replay_priorities, 0, 0) == [b"45"]
    check_records(s.batch, int_ids(s.ids))


def test_eviction_of_a_batch_larger_than_capacity(r, keys):
    """One insert larger than the capacity (and than the script's 4000-argument chunks)
    keeps only its newest transitions."""
    replay = PrioritizedReplay(r, keys, LAYOUT, 500)
    assert replay.insert(make_records(range(5000)), np.linspace(10, 1, 5000)) == 4500
    assert replay.stats() == {"size": 500, "inserted": 5000, "evicted": 4500, "batches": 0}
    assert members(r, keys.replay_priorities) == list(range(4500, 5000))
    assert r.hlen(keys.replay_data) == 500
    check_records(LAYOUT.unpack(r.hmget(keys.replay_data, [4500, 4777, 4999])), [4500, 4777, 4999])


def test_insert_is_idempotent_by_batch_id(r, keys):
    replay = PrioritizedReplay(r, keys, LAYOUT, 100)
    assert replay.insert(make_records(range(10)), np.ones(10), batch_id="actor3-17") == 0
    assert replay.insert(make_records(range(10)), np.ones(10), batch_id="actor3-17") == -1
    assert replay.stats() == {"size": 10, "inserted": 10, "evicted": 0, "batches": 1}
    assert replay.insert(make_records(range(10, 15)), np.ones(5), batch_id="actor3-18") == 0
    # an empty batch id means "no idempotence": both inserts count
    replay.insert(make_records(range(15, 17)), np.ones(2))
    replay.insert(make_records(range(17, 19)), np.ones(2))
    assert replay.stats() == {"size": 19, "inserted": 19, "evicted": 0, "batches": 2}
    assert members(r, keys.replay_priorities) == list(range(19))


def test_batch_id_markers_are_bounded_by_the_eviction(r, keys):
    replay = PrioritizedReplay(r, keys, LAYOUT, 100)
    for b in range(50):  # 500 transitions through a replay of 100
        replay.insert(make_records(range(b * 10, b * 10 + 10)), np.ones(10), batch_id=f"b{b}")
    remembered = {m.decode() for m in r.zrange(keys.replay_batches, 0, -1)}
    assert remembered == {f"b{b}" for b in range(40, 50)}  # exactly the batches still present
    assert replay.stats()["batches"] == 50  # but every insert is counted
    assert replay.insert(make_records(range(10)), np.ones(10), batch_id="b49") == -1


def test_insert_rejects_bad_input(r, keys):
    replay = PrioritizedReplay(r, keys, LAYOUT, 100)
    with pytest.raises(ValueError, match="length"):
        replay.insert(make_records(range(3)), np.ones(2))
    with pytest.raises(ValueError, match="size"):
        replay.insert([*make_records(range(2)), b"short"], np.ones(3))
    assert replay.stats() == {"size": 0, "inserted": 0, "evicted": 0, "batches": 0}


# -- priority updates


def test_update_priorities_only_touches_present_transitions(r, keys):
    replay = PrioritizedReplay(r, keys, LAYOUT, 10, alpha=0.7, seed=4)
    replay.insert(make_records(range(15)), 1.0 + 0.1 * np.arange(15))  # ids 0-4 evicted
    assert members(r, keys.replay_priorities) == list(range(5, 15))

    def count_of(member: bytes, batches: int = 100) -> int:
        return sum(replay.sample(4).ids.count(member) for _ in range(batches))

    before = count_of(b"5")  # lowest priority: rank 10
    replay.update_priorities([b"2", b"7"], np.array([1000.0, 0.01]))
    assert r.zscore(keys.replay_priorities, "2") is None  # evicted: not brought back
    assert not r.hexists(keys.replay_data, "2")
    assert r.zcard(keys.replay_priorities) == 10
    assert r.zscore(keys.replay_priorities, "7") == 0.01
    assert r.zrange(keys.replay_priorities, 0, 0) == [b"7"]

    # raise id 5 to the top: it becomes rank 1; P(rank 1) > 1/4, so the first of the
    # 4 strata always draws it
    replay.update_priorities([b"5"], np.array([50.0]))
    assert r.zrevrange(keys.replay_priorities, 0, 0) == [b"5"]
    assert replay.rank_probabilities(10)[0] > 1 / 4
    for _ in range(20):
        assert replay.sample(4).ids[0] == b"5"
    after = count_of(b"5")
    assert after > 3 * before
    # updating through the ids a sample returned works the same way
    s = replay.sample(4)
    replay.update_priorities(s.ids, np.full(len(s.ids), 0.5))
    assert {r.zscore(keys.replay_priorities, i) for i in s.ids} == {0.5}
    replay.update_priorities([], np.array([]))  # a no-op


# -- record layout


def test_record_layout_round_trips_image_observations(r, keys):
    layout = RecordLayout((4, 84, 84), "uint8")
    assert layout.size == 2 * 4 * 84 * 84 + 12
    rng = np.random.default_rng(0)
    n = 3
    obs = rng.integers(0, 256, (n, 4, 84, 84), dtype=np.uint8)
    nxt = rng.integers(0, 256, (n, 4, 84, 84), dtype=np.uint8)
    action, ret, disc = np.array([0, 5, 17]), np.array([1.5, -2.0, 0.25]), np.array([0.99, 0, 1])
    records = layout.pack(obs, action, ret, disc, nxt)
    assert [len(x) for x in records] == [layout.size] * n
    back = layout.unpack(records)
    np.testing.assert_array_equal(back["obs"], obs)
    np.testing.assert_array_equal(back["next_obs"], nxt)
    np.testing.assert_array_equal(back["action"], action)
    np.testing.assert_array_equal(back["ret"], ret.astype(np.float32))
    np.testing.assert_array_equal(back["disc"], disc.astype(np.float32))
    for bad in (records[0][:-1], records[0] + b"\0", b""):
        with pytest.raises(ValueError, match="wrong size"):
            layout.unpack([records[1], bad])

    # and through Redis
    replay = PrioritizedReplay(r, keys, layout, 10, seed=0)
    replay.insert(records, np.array([3.0, 2.0, 1.0]))
    s = replay.sample(2)
    got = layout.unpack(r.hmget(keys.replay_data, s.ids))
    np.testing.assert_array_equal(s.batch, got)
    np.testing.assert_array_equal(s.batch["obs"], obs[int_ids(s.ids)])
