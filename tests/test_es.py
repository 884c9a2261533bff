import hashlib
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from qrl.actors.es import ESWorker
from qrl.algos.es.config import ESConfig
from qrl.algos.es.keys import es_params, es_results
from qrl.algos.es.messages import es_results_schema, pairs_per_message
from qrl.algos.es.strategy import (
    Adam,
    NoiseTable,
    PolicySpec,
    centered_ranks,
    es_gradient,
    normalize,
    pair_ranks,
)
from qrl.learners.es import ESMaster
from qrl.rl.envspec import EnvSpec
from qrl.runtime.loop import run_role
from qrl.runtime.runs import create_run
from qrl.wire.chunks import encode_whole
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.connection import connect
from qrl.wire.streams import FIELD, GROUP
from qrl.wire.weights import WEIGHTS
from tests.cli import ROOT, eval_confirmation, train
from tests.helpers import es_payload, far_redis, wait_until


def test_centered_ranks():
    x = np.array([3.0, -1.0, 10.0, 0.0, 3.0])
    r = centered_ranks(x)
    np.testing.assert_allclose(r, [0.0, -0.5, 0.5, -0.25, 0.25])  # ties get distinct ranks
    m = centered_ranks(np.array([[1.0, 5.0], [2.0, 0.0]]))
    assert m.shape == (2, 2) and m.min() == -0.5 and m.max() == 0.5
    assert centered_ranks(np.array([7.0])).tolist() == [0.0]
    big = centered_ranks(np.random.default_rng(0).standard_normal(1001))
    assert big.sum() == pytest.approx(0.0, abs=1e-4)


def test_pair_ranks_weigh_each_pair_by_its_own_difference():
    # pair 0 played two hard starts (-1200 vs -1000), pair 1 two easy ones (-150 vs -100)
    pos, neg = np.array([-1200.0, -150.0, 7.0, 3.0]), np.array([-1000.0, -100.0, 7.0, 1.0])
    w = pair_ranks(pos, neg)
    # |differences| 200, 50, 0, 2 rank 4, 3, 1, 2 of 4; the sign is the better half's
    np.testing.assert_allclose(w, [-1.0, -0.75, 0.0, 0.5])
    assert w.dtype == np.float32
    # centered ranks over all returns give the hard pair's difference the weight of the easy
    # one's and the tie a rank gap of its own; the pair difference puts the larger gap first
    flat = centered_ranks(np.stack([pos, neg]))
    assert abs(flat[0, 0] - flat[1, 0]) == pytest.approx(abs(flat[0, 1] - flat[1, 1]))
    assert pair_ranks(np.array([1.0]), np.array([1.0])).tolist() == [0.0]
    with pytest.raises(ValueError, match="unknown fitness shaping"):
        es_gradient(np.ones((4, 2), np.float32), pos, neg, 0.1, "pair-ranks")


def _digest(seed: int, size: int) -> str:
    return hashlib.sha256(NoiseTable(seed, size).noise.tobytes()).hexdigest()


@pytest.mark.slow
def test_noise_table_is_identical_across_processes():
    code = "import sys; from tests.test_es import _digest; print(_digest(5, 100_000))"
    others = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert others == {_digest(5, 100_000)}
    assert _digest(6, 100_000) != _digest(5, 100_000)
    t = NoiseTable(5, 1000)
    assert t.noise.dtype == np.float32 and abs(t.noise.std() - 1) < 0.1
    i = t.sample_index(np.random.default_rng(0), 10)
    assert 0 <= i <= 990 and t.get(i, 10).shape == (10,)


@pytest.mark.parametrize("shaping", ["ranks", "pair_ranks"])
def test_es_update_converges_on_a_quadratic(shaping):
    dim, sigma, pairs = 10, 0.1, 25
    target = np.linspace(-1, 1, dim).astype(np.float32)
    f = lambda th: -np.sum((th - target) ** 2, axis=-1)  # noqa: E731
    noise, rng = NoiseTable(0, 100_000), np.random.default_rng(0)
    theta, adam = np.zeros(dim, np.float32), Adam(dim, lr=0.05)
    start = np.linalg.norm(theta - target)
    for _ in range(300):
        idx = [noise.sample_index(rng, dim) for _ in range(pairs)]
        eps = np.stack([noise.get(i, dim) for i in idx])
        grad = es_gradient(eps, f(theta + sigma * eps), f(theta - sigma * eps), sigma, shaping)
        theta = theta + adam.step(grad)
    assert np.linalg.norm(theta - target) < 0.05 * start


def test_policy_spec_acts_for_discrete_and_continuous():
    spec = PolicySpec.for_env(EnvSpec.of("CartPole-v1"), (8,))
    assert spec.discrete and spec.dim == 4 * 8 + 8 + 8 * 2 + 2
    theta = spec.init(np.random.default_rng(0))
    obs = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    a = spec.act(theta, obs)
    assert a.shape == (5,) and set(a.tolist()) <= {0, 1}
    # a batch of parameter vectors, one per row, equals acting row by row
    many = np.stack([theta + 0.1 * k for k in range(5)])
    np.testing.assert_array_equal(
        spec.act(many, obs), [spec.act(many[k], obs[k : k + 1])[0] for k in range(5)]
    )
    pend = PolicySpec.for_env(EnvSpec.of("Pendulum-v1"), (8,))
    act = pend.act(pend.init(np.random.default_rng(0)) * 50, np.ones((3, 3), np.float32))
    assert act.shape == (3, 1) and (np.abs(act) <= 2.0).all()


def test_master_ignores_stale_results_and_resumes(r, keys, redis_server):
    cfg = ESConfig(population=4, noise_size=10_000, obs_norm=False)
    create_run(r, keys, "es", cfg)
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    master.generation = 3
    master.publish()
    theta0 = master.theta.copy()
    # two stale pairs (generation 2) that would pull theta elsewhere, then the real ones
    r.xadd(es_results(keys), {FIELD: es_payload(2, [5, 6], [100.0, 100.0], [-100.0, -100.0])})
    r.xadd(es_results(keys), {FIELD: es_payload(3, [10, 20], [1.0, 0.0], [0.0, 2.0])})
    assert run_role(master, r, keys, 0, lambda: False, limit=1) == 1
    assert master.stale == 2 and master.generation == 4
    # the update used exactly the current generation's pairs
    spec_dim = master.spec.dim
    eps = np.stack([master.noise.get(10, spec_dim), master.noise.get(20, spec_dim)])
    adam = Adam(spec_dim, cfg.lr)
    rp, rn = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    grad = es_gradient(eps, rp, rn, cfg.sigma, cfg.shaping) - cfg.l2 * theta0
    np.testing.assert_allclose(master.theta, theta0 + adam.step(grad), rtol=1e-5, atol=1e-7)
    assert r.xlen(es_results(keys)) == 0 and r.xpending(es_results(keys), GROUP)["pending"] == 0
    # a restarted master resumes from the last published generation
    again = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    assert again.resumed and again.generation == 4
    np.testing.assert_array_equal(again.theta, master.theta)
    np.testing.assert_array_equal(again.adam.m, master.adam.m)
    assert again.adam.t == 1


def test_pairs_that_draw_the_same_noise_index_keep_their_own_halves(r, keys, redis_server):
    """A noise table just one noise vector long: every pair in flight draws index 0. Each
    pair's two halves must still be matched with each other (one env seed: with sigma so
    small that theta +- sigma eps is theta, both play the same episode) and none lost."""
    hidden = 143  # CartPole's policy then has 7 x 143 + 2 = 1003 parameters: the table's size
    # seed 5: an initial policy whose episodes last 17-61 steps, by their start; 5 slots: the
    # halves of a pair do not always start (and end) in the same step
    cfg = ESConfig(
        seed=5,
        hidden=(hidden,),
        noise_size=1003,
        sigma=1e-30,
        obs_norm=False,
        envs_per_worker=5,
        batch_pairs=1,
        push_interval=0.0,
    )
    create_run(r, keys, "es", cfg)
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    assert master.spec.dim == cfg.noise_size
    master.start(lambda: False)  # publishes generation 0
    worker = ESWorker(r, keys, cfg, worker_id=0)
    run_role(worker, r, keys, 0, lambda: False, limit=3000)
    worker.push(lambda: False)
    results = []
    while batch := master.consumer.read():
        results += [e.data for e in batch]
    n = sum(len(d["index"]) for d in results)
    assert n >= 10 and all((d["index"] == 0).all() for d in results)
    for d in results:  # both halves of every pair played one start
        np.testing.assert_array_equal(d["length_pos"], d["length_neg"])
        np.testing.assert_array_equal(d["return_pos"], d["return_neg"])
    jobs = np.concatenate([d["job"] for d in results])
    assert len(set(jobs.tolist())) == n  # one id per pair
    waiting = sum(len(h) for h in worker.halves.values())  # halves whose twin still plays
    assert worker.episodes == 2 * n + waiting  # no half lost


def _results(gen: int, count: float, mean: float, length: int, pairs: int = 2) -> bytes:
    """A results message of ``pairs`` pairs of ``length``-step episodes whose observations
    all have the value ``mean`` (``count`` of them, as the message claims)."""
    return encode(
        "es.results",
        {
            "generation": gen,
            "job": np.arange(pairs, dtype=np.int64),
            "index": np.arange(pairs, dtype=np.int64) * 7,
            "return_pos": np.ones(pairs, np.float32),
            "return_neg": np.zeros(pairs, np.float32),
            "length_pos": np.full(pairs, length, np.int32),
            "length_neg": np.full(pairs, length, np.int32),
            "obs_sum": np.full(4, count * mean),
            "obs_sumsq": np.full(4, count * (mean**2 + (1.0 if mean < 1e3 else 0.0))),
            "obs_count": float(count),
            "worker": 0,
            "batch": uuid.uuid4().hex,
        },
    )


def test_one_results_message_weighs_no_more_than_the_episodes_it_reports(r, keys, redis_server):
    """Issue 68, finding 4: a well-formed message counting 2^40 observations of 1e6 passed the
    checks, and every real observation then normalized to -5 for good. A message's count may
    not exceed the steps of the episodes it reports (each at most the env's limit, a message
    at most a generation's pairs): the 2^40 one is refused, and the heaviest one admitted
    (2 pairs of 500-step CartPole episodes, all 1e6) is diluted by honest generations."""
    cfg = ESConfig(population=4, noise_size=10_000)  # obs_norm on; 2 pairs a generation
    create_run(r, keys, "es", cfg)
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    master.start(lambda: False)

    def generation(*payloads: bytes) -> None:
        gen = master.generation
        for payload in payloads:
            r.xadd(es_results(keys), {FIELD: payload})
        while master.generation == gen:
            master.step(lambda: False)

    def honest_normalized() -> float:  # an honest observation (0.1) as the workers see it
        mean, std = master.obs_stats()
        return float(normalize(np.full(4, 0.1), mean, std)[0])

    generation(_results(0, 2.0**40, 1e6, 1), _results(0, 80, 0.1, 20))
    assert master.obs_count < 100 and abs(honest_normalized()) < 0.5  # the 2^40 one refused
    generation(_results(master.generation, 2 * 2 * 500, 1e6, 500))  # the most one may carry
    assert honest_normalized() < -4.9  # poisoned, for now
    for _ in range(100):
        generation(_results(master.generation, 80, 0.1, 20))
    assert honest_normalized() > -1.0  # honest generations dilute it (1e6 is a fifth of it)


def test_a_workers_messages_count_exactly_the_steps_they_report(r, keys, redis_server):
    """Each message's observation statistics are those of its pairs' episodes (not of every
    step since the last push, episodes in flight included), and it carries at most a
    generation's pairs: what the master's check admits."""
    cfg = ESConfig(
        seed=3, population=4, noise_size=10_000, envs_per_worker=5, batch_pairs=3, push_interval=0.0
    )
    create_run(r, keys, "es", cfg)
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    master.start(lambda: False)
    worker = ESWorker(r, keys, cfg, worker_id=0)
    run_role(worker, r, keys, 0, lambda: False, limit=1000)
    schema = es_results_schema(4, cfg.noise_size, master.spec.dim)  # no bounds but its own
    found = [decode(v[FIELD], schema) for _, v in r.xrange(es_results(keys))]
    assert len(found) >= 2
    for d in found:
        assert len(d["index"]) <= pairs_per_message(cfg) == 2
        assert d["obs_count"] == d["length_pos"].sum() + d["length_neg"].sum()


def test_a_worker_far_from_redis_looks_and_pushes_off_its_path(r, keys, redis_server):
    """5 ms from Redis, a worker's looks for a new generation and its pushes run on threads
    of their own (in line, a look every 5 ms would cost a round trip about every step); its
    messages still count exactly their steps, and it takes up the next generation."""
    cfg = ESConfig(
        seed=3, population=4, noise_size=10_000, envs_per_worker=5, batch_pairs=3, push_interval=0.0
    )
    create_run(r, keys, "es", cfg)
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    master.start(lambda: False)
    with far_redis(redis_server.port, rtt_ms=5.0) as far:
        worker = ESWorker(far, keys, cfg, worker_id=0)
        run_role(worker, far, keys, 0, lambda: False, limit=1000)
        assert not worker.looking.in_line and not worker.pushing.in_line
        schema = es_results_schema(4, cfg.noise_size, master.spec.dim)
        found = [decode(v[FIELD], schema) for _, v in r.xrange(es_results(keys))]
        assert len(found) >= 2
        for d in found:
            assert d["obs_count"] == d["length_pos"].sum() + d["length_neg"].sum()
        assert run_role(master, r, keys, 0, lambda: False, limit=1) == 1
        taken = wait_until(
            lambda: worker.step(lambda: False) and worker.generation == 1,
            "the worker to take up generation 1",
            30,
            every=0.01,
        )
        worker.close(lambda: False)
        assert taken and worker.abandoned == cfg.envs_per_worker


def test_results_need_one_job_id_per_pair():
    schema = es_results_schema(4, 10_000, 114)
    msg = decode(es_payload(0, [10, 20], [1.0, 0.0], [0.0, 2.0]), schema)
    assert msg["job"].tolist() == [0, 1]
    for job, reason in [([3, 3], "job ids repeat"), ([1], "job has 1"), ([-1, 2], "job")]:
        bad = {**msg, "job": np.array(job, np.int64)}
        with pytest.raises(CodecError, match=reason):
            decode(encode("es.results", bad), schema)
    with pytest.raises(CodecError, match="job"):
        decode(encode("es.results", {k: v for k, v in msg.items() if k != "job"}), schema)


@pytest.mark.slow
def test_train_es_cli_learns_cartpole(tmp_path):
    run_dir = tmp_path / "run"
    result = train(
        "es",
        run_dir,
        "--env",
        "CartPole-v1",
        "--seed",
        "1",
        "--target-return",
        "300",
        "--max-time",
        "90",
        timeout=200,
    )
    assert result["reached"] and result["eval_return"] >= 300  # random play scores ~22
    assert "es step" in eval_confirmation(run_dir)
    # ES workers keep the master's priority (--actor-nice is for network-training learners)
    base = f"(nice {os.nice(0)})"
    assert base in (run_dir / "logs" / "master.log").read_text()
    assert base in (run_dir / "logs" / "worker0.log").read_text()


def test_master_resumes_from_its_checkpoint_when_redis_has_nothing(r, keys, redis_server, tmp_path):
    cfg = ESConfig(population=4, noise_size=10_000)
    create_run(r, keys, "es", cfg)
    ckpt = tmp_path / "es.pt"
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg, checkpoint=ckpt)
    master.generation, master.adam.t = 7, 3
    master.theta = master.theta + 1.0
    master.save()
    r.delete(es_params(keys))  # e.g. a Redis without persistence was restarted
    again = ESMaster(lambda: connect(redis_server.url), keys, cfg, checkpoint=ckpt)
    assert again.resumed and again.generation == 7 and again.adam.t == 3
    np.testing.assert_array_equal(again.theta, master.theta)


def test_a_result_with_zero_count_and_huge_sums_cannot_wedge_the_master(r, keys, redis_server):
    """Issue 12, finding 3: obs_count=0 with obs_sum = obs_sumsq = 1e308 made the master's
    observation statistics inf/NaN for good. It is now refused at decode (dead-lettered) and
    the generation goes on with the valid results, its published statistics finite."""
    from qrl.wire.weights import WeightStore

    cfg = ESConfig(population=4, noise_size=10_000)
    create_run(r, keys, "es", cfg)
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    master.publish()
    hostile = es_payload(0, [1, 2], [1.0, 0.0], [0.0, 1.0], 0.0, 1e308, 1e308)
    r.xadd(es_results(keys), {FIELD: hostile})
    r.xadd(
        es_results(keys),
        {FIELD: es_payload(0, [10, 20], [1.0, 0.0], [0.0, 2.0], 8.0, 4.0, 9.0)},
    )
    assert run_role(master, r, keys, 0, lambda: False, limit=1) == 1
    w = WeightStore(r, keys, es_params(keys)).fetch()  # a worker's view: valid, finite
    assert w is not None and w.version == 1
    assert all(np.isfinite(v).all() for v in w.params.values())
    assert master.obs_count == pytest.approx(1e-2 + 8.0)
    reasons = [f[b"reason"].decode() for _, f in r.xrange(keys.deadletter)]
    assert len(reasons) == 1 and "observation count 0.0" in reasons[0]


def test_master_refuses_to_apply_or_publish_non_finite_state(r, keys, redis_server):
    """The master's own guard, behind the schema: results whose update would make the
    statistics non-finite are dropped, nothing is published, and the next ones go in."""
    from qrl.wire.streams import Entry

    cfg = ESConfig(population=4, noise_size=10_000)
    create_run(r, keys, "es", cfg)
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    master.start(lambda: False)
    theta, blob = master.theta.copy(), r.hget(es_params(keys), "blob")

    def entry(obs_sum: float) -> Entry:
        return Entry(
            "0-1",
            {
                "generation": 0,
                "index": np.array([3, 4]),
                "return_pos": np.array([1.0, 2.0], np.float32),
                "return_neg": np.array([0.0, 1.0], np.float32),
                "obs_count": 1.0,
                "obs_sum": np.full(4, obs_sum),
                "obs_sumsq": np.full(4, 1e308),
            },
        )

    master.fold(entry(1e308))  # (1e308)^2 overflows: the statistics would be inf/NaN
    assert not master.apply()
    assert master.generation == 0 and master.refused == 2
    np.testing.assert_array_equal(master.theta, theta)
    assert r.hget(es_params(keys), "blob") == blob  # nothing published
    assert np.isfinite(master.obs_sum).all() and master.metrics()["refused"] == 2
    # a finite generation afterwards is applied and published
    master.fold(entry(0.0))
    master.obs_new[2] = np.zeros(4)
    assert master.apply() and master.generation == 1
    assert r.hget(es_params(keys), "version") == b"1"


def test_master_publishes_again_when_its_parameters_key_is_overwritten(r, keys, redis_server):
    """Garbage written over the current generation's blob would leave workers on the old
    generation and the master waiting for results that never come: once it has waited, the
    master publishes its parameters again as the next generation."""
    from qrl.wire.weights import WeightStore

    cfg = ESConfig(population=4, noise_size=10_000)
    create_run(r, keys, "es", cfg)
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    master.start(lambda: False)
    master.step(lambda: False)
    assert master.generation == 0  # waited less than CHECK_AFTER with the key intact
    master.waiting_since -= 10
    master.step(lambda: False)  # checked: the key holds generation 0, nothing to do
    assert master.generation == 0
    r.hset(es_params(keys), "blob", b"garbage")
    master.waiting_since -= 10
    master.step(lambda: False)
    assert master.generation == 1
    w = WeightStore(r, keys, es_params(keys)).fetch()
    assert w is not None and w.version == 1
    np.testing.assert_array_equal(w.params["theta"], master.theta)


def test_master_publishes_again_when_another_writer_stores_its_generation(r, keys, redis_server):
    """A valid blob of the master's own generation written by another writer: the version
    matches, so only the blob tells that workers would evaluate parameters the master does
    not have. The master publishes its own again as the next generation."""
    from qrl.wire.weights import WeightStore

    cfg = ESConfig(population=4, noise_size=10_000)
    create_run(r, keys, "es", cfg)
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg)
    master.start(lambda: False)
    elsewhere = f"{es_params(keys)}:elsewhere"
    theirs = {"theta": master.theta + 1.0}
    WeightStore(r, keys, elsewhere).publish(theirs, version=0, meta=master.meta())
    r.hset(es_params(keys), "blob", r.hget(elsewhere, "blob"))
    w = WeightStore(r, keys, es_params(keys)).fetch()
    assert w is not None and w.version == 0  # a valid blob of generation 0, not the master's
    master.waiting_since -= 10
    master.step(lambda: False)
    assert master.generation == 1
    w = WeightStore(r, keys, es_params(keys)).fetch()
    assert w is not None and w.version == 1
    np.testing.assert_array_equal(w.params["theta"], master.theta)


def test_center_policy_refuses_parameters_that_do_not_fit():
    from qrl.learners.es import policy_from_params

    cfg = ESConfig()
    with pytest.raises(ValueError, match="do not fit"):
        # e.g. garbage in the parameters key
        policy_from_params(cfg, EnvSpec.of(cfg.env), {"x": np.ones(3)})


def test_a_far_ahead_generation_neither_freezes_es_nor_strands_workers(
    r, keys, redis_server, tmp_path, monkeypatch
):
    """Issue 28, finding 3 for ES: ``HSET es:params version 2**53-2`` (with the blob left, or
    with a valid blob of that generation) during a master+worker exchange. The master counts
    on from its own generation, the workers follow it back down, and a restarted master does
    not resume at the injected generation."""
    from qrl.wire.weights import MAX_VERSION

    monkeypatch.setattr("qrl.learners.es.CHECK_AFTER", 0.2)
    huge = MAX_VERSION - 1
    cfg = ESConfig(
        population=4, noise_size=10_000, envs_per_worker=2, batch_pairs=1, push_interval=0.0
    )
    create_run(r, keys, "es", cfg)
    ckpt = tmp_path / "es.pt"
    master = ESMaster(lambda: connect(redis_server.url), keys, cfg, checkpoint=ckpt)
    master.consumer.block_ms = 1  # the worker steps in between
    worker = ESWorker(connect(redis_server.url), keys, cfg, poll_every=0.0)
    stop = lambda: False  # noqa: E731
    master.start(stop)
    worker.start(stop)

    def turn() -> None:
        for _ in range(20):
            worker.step(stop)
        master.step(stop)

    def exchange(generations: int) -> None:
        goal = master.generation + generations
        wait_until(
            lambda: (master.generation, worker.generation),
            f"{generations} generations, the worker on the master's",
            20,
            until=lambda g: g[0] >= goal and g[1] == g[0],
            between=turn,
            every=0,
        )

    exchange(2)
    for valid in (False, True):
        version = huge - valid  # another version each time (a rejected one is not read again)
        mapping: dict = {"version": version}
        if valid:
            params = {k: np.asarray(v) for k, v in master.params().items()}
            mapping["blob"] = encode_whole(WEIGHTS, {"params": params}, version)
        r.hset(es_params(keys), mapping=mapping)
        before = master.generation
        exchange(2)
        assert before + 2 <= master.generation < before + 10  # its own count, not huge + 1
        assert int(r.hget(es_params(keys), "version")) == master.generation
    master.save()
    params = {k: np.asarray(v) for k, v in master.params().items()}
    blob = encode_whole(WEIGHTS, {"params": params}, huge)
    r.hset(es_params(keys), mapping={"version": huge, "blob": blob})
    again = ESMaster(lambda: connect(redis_server.url), keys, cfg, checkpoint=ckpt)
    assert again.generation == master.generation  # from its checkpoint, not huge
    again.start(stop)
    assert int(r.hget(es_params(keys), "version")) == master.generation
