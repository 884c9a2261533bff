"""Bad input on every stream and weight key: more than 10,000 malformed payloads (see
``tests/corpus.py``) are each rejected with a reason in the dead-letter stream, the
consumers (real role processes) keep running, and the replay and weights stay intact."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from qrl.actors.es import ESWorker
from qrl.algos import ALGOS
from qrl.algos.apex.config import ApexConfig
from qrl.algos.apex_family.messages import experience_schema
from qrl.algos.es.config import ESConfig
from qrl.algos.es.keys import es_params, es_results
from qrl.algos.es.messages import es_results_schema
from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import unroll_schema
from qrl.runtime.metrics import METRICS, MetricsReader
from qrl.runtime.runs import create_run
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WEIGHTS, WeightStore, module_arrays
from tests.cli import role
from tests.corpus import corpus
from tests.helpers import kill_all, make_actor, next_unroll, wait_until

PER_STREAM = 3_000  # x 3 role-consumed streams, + metrics and both weight keys: > 10,000
OTHER = encode("metrics", {"time": 1.0, "values": {}})


def _experience(n: int, batch: str) -> dict:
    rng = np.random.default_rng(len(batch))
    obs = rng.standard_normal((n, 4)).astype(np.float32)
    return {
        "obs": obs,
        "action": rng.integers(0, 2, n).astype(np.int32),
        "ret": rng.standard_normal(n).astype(np.float32),
        "disc": np.full(n, 0.97, np.float32),
        "next_obs": obs + 0.1,
        "priority": rng.random(n).astype(np.float32),
        "version": 0,
        "actor": 0,
        "batch": batch,
    }


def _es_results(cfg: ESConfig, dim: int) -> dict:
    n = 4
    return {
        "generation": 0,
        "job": np.arange(n, dtype=np.int64),
        "index": np.arange(n, dtype=np.int64) * 7,
        "return_pos": np.ones(n, np.float32),
        "return_neg": np.zeros(n, np.float32),
        "length_pos": np.full(n, 10, np.int32),
        "length_neg": np.full(n, 10, np.int32),
        "obs_sum": np.zeros(4),
        "obs_sumsq": np.ones(4),
        "obs_count": 40.0,
        "worker": 0,
        "batch": "w0-g0",
    }


def _until(cond, what: str, timeout: float = 180.0) -> None:
    wait_until(cond, what, timeout)


def _inject(r, stream: str, payloads) -> int:
    pipe, n = r.pipeline(transaction=False), 0
    for _, payload in payloads:
        pipe.xadd(stream, {"d": payload})
        n += 1
        if n % 500 == 0:
            pipe.execute()
    pipe.execute()
    return n


def _rejected(r, keys: RunKeys, source: str) -> int:
    return int(r.hget(keys.stats, f"rejected:{source}") or 0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_malformed_payloads_on_every_stream_and_weight_key(r, keys):
    apex, impala, es = (RunKeys(f"{keys.run[:50]}-{a}") for a in ("apex", "impala", "es"))
    acfg, icfg, ecfg = ApexConfig(), ImpalaConfig(envs_per_actor=4, unroll=10), ESConfig()
    for k, algo, cfg in ((apex, "apex", acfg), (impala, "impala", icfg), (es, "es", ecfg)):
        create_run(r, k, algo, cfg)
    roles = [
        role("replay", "--run", apex.run),
        role("learner", "impala", "--run", impala.run),
        role("es", "master", "--run", es.run),
    ]
    try:
        _until(lambda: r.exists(impala.weights) and r.exists(es_params(es)), "initial weights")
        # valid traffic before the attack: the replay holds exactly these 16 transitions
        for b in ("good-1", "good-2"):
            r.xadd(apex.experience, {"d": encode("apex.experience", _experience(8, b))})
        _until(lambda: r.zcard(apex.replay_priorities) == 16, "valid batches in the replay")
        impala_blob = r.hget(impala.weights, "blob")
        es_blob = r.hget(es_params(es), "blob")
        dim = ESWorker(r, es, ecfg, 0).spec.dim

        actor = make_actor("impala", r, impala, icfg)
        assert actor.weights.refresh() and actor.weights.version == 0  # its unrolls say 0
        unrolls = next_unroll(actor)
        targets = [
            (
                apex,
                apex.experience,
                "apex.experience",
                _experience(8, "x"),
                experience_schema((4,), "float32", 2),
            ),
            (
                impala,
                trajectories(impala),
                "impala.unrolls",
                unrolls,
                unroll_schema((4,), "float32", 2, icfg.unroll),
            ),
            (
                es,
                es_results(es),
                "es.results",
                _es_results(ecfg, dim),
                es_results_schema(4, ecfg.noise_size, dim),
            ),
        ]
        total = 0
        for _k, stream, kind, msg, schema in targets:
            total += _inject(r, stream, corpus(kind, msg, schema, OTHER, PER_STREAM))
        for k, stream, *_ in targets:
            source = stream.removeprefix(k.prefix)  # e.g. "es:results"
            _until(lambda k=k, s=source: _rejected(r, k, s) >= PER_STREAM, f"{source} rejected")
            assert _rejected(r, k, source) == PER_STREAM  # each exactly once
            assert r.xlen(stream) == 0  # and acknowledged: nothing left behind
        assert all(p.poll() is None for p in roles), "a consumer died"

        # no learner published anything from the garbage
        assert r.hget(impala.weights, "blob") == impala_blob
        assert r.hget(es_params(es), "blob") == es_blob
        # and both still learn: valid entries after the attack move their versions
        _learns_after_the_attack(r, impala, es, actor, ecfg, dim)

        # an actor's metrics: whoever follows them (qrl train, --run-dir) rejects too
        metrics_msg = {"time": 1.0, "values": {"steps": 1}}
        junk = corpus("metrics", metrics_msg, METRICS, OTHER, 500)
        total += _inject(r, apex.metrics("actor", 0), junk)
        got = MetricsReader(r, apex, ALGOS["apex"].reporters(acfg), from_start=True).read()
        assert {m["role"] for m in got} <= {"replay"}  # only the replay role's own reports
        assert _rejected(r, apex, "metrics") == 500

        assert r.zcard(apex.replay_priorities) == 16 and r.zcard(apex.replay_batches) == 2
        # and the consumers still work: a valid batch after the attack goes in
        r.xadd(apex.experience, {"d": encode("apex.experience", _experience(8, "good-3"))})
        _until(lambda: r.zcard(apex.replay_priorities) == 24, "a valid batch after the attack")
        assert all(p.poll() is None for p in roles), "a consumer died"
        for p in roles:
            p.send_signal(signal.SIGTERM)
        assert [p.wait(60) for p in roles] == [0, 0, 0]

        # both weight keys, as actors and ES workers read them (this overwrites the keys:
        # what must stay intact is what the readers hold). The writers are stopped first: a
        # running learner or master puts its own blob back within a second of seeing a
        # writer's in its key, and a reader rightly takes that one.
        total += _attack_weights(r, impala, actor.weights, "weights", 400)
        total += _attack_weights(r, es, ESWorker(r, es, ecfg, 0), "es:params", 400)
        assert total > 10_000
        # every dead letter says why
        for k in (apex, impala, es):
            for _, fields in r.xrange(k.deadletter, count=20_000):
                assert fields[b"reason"] and fields[b"source"]
    finally:
        kill_all(roles)


def _learns_after_the_attack(r, impala, es, actor, ecfg: ESConfig, dim: int) -> None:
    """A batch's worth of valid unrolls makes the IMPALA learner publish a newer version,
    a generation's worth of valid results makes the ES master publish the next one."""
    impala_version = WeightStore(r, impala).version()
    for _ in range(-(-actor.cfg.batch_unrolls // actor.cfg.envs_per_actor)):
        r.xadd(trajectories(impala), {"d": encode("impala.unrolls", next_unroll(actor))})
    generation = int(r.hget(es_params(es), "version"))
    for i in range(ecfg.population // 2 // 4):  # _es_results holds 4 pairs
        results = {**_es_results(ecfg, dim), "generation": generation, "batch": f"good-{i}"}
        results["job"] = results["job"] + 4 * i
        r.xadd(es_results(es), {"d": encode("es.results", results)})
    _until(lambda: WeightStore(r, impala).version() > impala_version, "IMPALA to learn")
    _until(lambda: int(r.hget(es_params(es), "version")) > generation, "a new ES generation")


def _attack_weights(r, keys: RunKeys, reader, field: str, n: int) -> int:
    """Store ``n`` malformed blobs, one newer version at a time, and let ``reader`` (an
    actor's weights client or an ES worker) poll each: it must reject every one and keep its
    parameters."""
    store = WeightStore(r, keys, keys.weights if field == "weights" else es_params(keys))
    current = store.fetch()
    assert current is not None
    if hasattr(reader, "net"):
        reader.refresh()
        before = {k: v.copy() for k, v in module_arrays(reader.net).items()}
    else:
        reader.adopt(reader.newer())
        before = {"theta": reader.theta.copy()}
    start = reader.version if hasattr(reader, "net") else reader.generation
    for i in range(n):
        version = current.version + 1 + i
        msg = {"params": current.params, "meta": None}  # (the version: the manifest's)
        [(category, blob)] = corpus("weights", msg, WEIGHTS, OTHER, 1, seed=i, bombs=i == 0)
        r.hset(store.key, mapping={"version": version, "blob": blob})
        if hasattr(reader, "net"):
            assert not reader.refresh(), category
        else:
            assert reader.newer() is None, category
    assert _rejected(r, keys, field) == n
    if hasattr(reader, "net"):
        assert reader.version == start
        after = module_arrays(reader.net)
    else:
        assert reader.generation == start
        after = {"theta": reader.theta}
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value)
    return n
