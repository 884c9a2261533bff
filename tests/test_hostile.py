"""Property tests: hostile payloads that DECODE (valid envelopes, every schema, extreme
finite values, empty and huge shapes, every allowed dtype; see ``tests/strategies.py``) go
through each real consumer: the replay role's insert, the IMPALA learner's batch step, the ES
master's fold, the weights reader. Each must survive, hold and publish nothing non-finite,
and still take a valid entry afterwards. 2,000 examples per consumer; each consumer is built
once per module, not per example."""

from __future__ import annotations

import itertools
import json
import uuid
from functools import partial

import numpy as np
import pytest
import redis
import torch
from hypothesis import given
from hypothesis import strategies as st

from qrl.algos import ALGOS
from qrl.algos.apex.config import ApexConfig
from qrl.algos.es.config import ESConfig
from qrl.algos.es.keys import es_params
from qrl.algos.impala.config import ImpalaConfig
from qrl.learners.base import Learner
from qrl.learners.es import ESMaster
from qrl.learners.unrolls import stack_unrolls
from qrl.replay.role import ReplayFiller
from qrl.rl.models import QNetwork
from qrl.runtime.metrics import MetricsReader
from qrl.runtime.roles import UPDATES
from qrl.runtime.runlog import Progress
from qrl.runtime.runs import create_run
from qrl.runtime.status import collect
from qrl.wire.chunks import encode_whole
from qrl.wire.codec import decode, encode
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.streams import FIELD, Entry
from qrl.wire.weights import WEIGHTS, WeightStore, module_arrays
from tests import strategies as hs
from tests.helpers import make_learner

pytestmark = pytest.mark.slow

APEX = ApexConfig(replay_capacity=2000, actor_batch=48, envs_per_actor=4, n_step=4)  # 64 rows
IMPALA = ImpalaConfig(unroll=5, envs_per_actor=4, batch_unrolls=4, hidden=(16,), max_policy_lag=3)
ES = ESConfig(population=2, noise_size=10_000, hidden=(8,))
ES_DIM = 4 * 8 + 8 + 8 * 2 + 2  # CartPole: 4 -> 8 -> 2
NET = partial(QNetwork, (4,), 2, (16,), True)
NEVER = lambda: False  # noqa: E731


def _finite(*arrays) -> bool:
    return all(np.isfinite(np.asarray(a, dtype=np.float64)).all() for a in arrays)


def _published_finite(client: redis.Redis, keys: RunKeys, key: str) -> bool:
    w = WeightStore(client, keys, key).fetch()
    return w is not None and _finite(*w.params.values())


@pytest.fixture(scope="module")
def client(redis_server):
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


def _run(client: redis.Redis, algo: str, cfg) -> RunKeys:
    keys = RunKeys(f"hostile-{algo}-{uuid.uuid4().hex[:8]}")
    create_run(client, keys, algo, cfg)
    return keys


# -- the replay role's insert


@pytest.fixture(scope="module")
def filler(client):
    f = ReplayFiller(client, _run(client, "apex", APEX), APEX)
    yield f
    f.close(NEVER)


def _valid_experience(batch: str, n: int = 8) -> bytes:
    obs = np.ones((n, 4), np.float32)
    return encode(
        "apex.experience",
        {
            "obs": obs,
            "action": np.zeros(n, np.int32),
            "ret": np.ones(n, np.float32),
            "disc": np.full(n, 0.9, np.float32),
            "next_obs": obs,
            "priority": np.ones(n, np.float32),
            "version": 0,
            "actor": 0,
            "batch": batch,
        },
    )


@hs.HOSTILE
@given(msg=hs.experience(max_rows=64))
def test_replay_insert_survives_hostile_experience(filler, msg):
    r, keys = filler.client, filler.keys
    payload = encode("apex.experience", msg)
    decode(payload, filler.consumer.schema)  # it is valid as far as the wire goes
    valid = uuid.uuid4().hex
    r.xadd(keys.experience, {FIELD: payload})
    r.xadd(keys.experience, {FIELD: _valid_experience(valid)})  # right behind it
    filler.step(NEVER)  # one read takes both
    assert filler.consumer.rejected == 0 and r.xlen(keys.experience) == 0
    assert r.zscore(keys.replay_batches, valid) is not None  # the valid one went in
    s = filler.replay.sample(16)
    assert _finite(s.weights, *(s.batch[k] for k in ("obs", "ret", "disc", "next_obs")))


# -- the IMPALA learner's batch step


@pytest.fixture(scope="module")
def impala(client, redis_server):
    lrn = make_learner(redis_server.url, _run(client, "impala", IMPALA), IMPALA)
    lrn.publish()
    yield lrn
    lrn.close(NEVER)


def _feed(lrn: Learner, msg: dict) -> None:
    """As the learner's step takes a batch from its loader: decoded, stacked, admitted (the
    policy lag), trained on."""
    data = decode(encode("impala.unrolls", msg), lrn.source.source.spec.schema())
    batch = lrn.source.source.admit(stack_unrolls([Entry("0-1", data)], lrn.device), lrn.updates)
    if batch is not None:
        lrn.train(batch)


def _valid_unrolls(version: int) -> dict:
    t, b = IMPALA.unroll, IMPALA.envs_per_actor
    return {
        "obs": np.zeros((t + 1, b, 4), np.float32),
        "action": np.zeros((t, b), np.int32),
        "reward": np.ones((t, b), np.float32),
        "terminated": np.zeros((t, b), bool),
        "truncated": np.zeros((t, b), bool),
        "logits": np.zeros((t, b, 2), np.float32),
        "trunc_obs": np.zeros((0, 4), np.float32),
        "trunc_idx": np.zeros((0, 2), np.int32),
        "version": version,
        "actor": 0,
        "batch": "valid",
    }


@hs.HOSTILE
@given(msg=hs.unrolls(IMPALA.unroll, IMPALA.envs_per_actor), recent=st.booleans())
def test_impala_learner_survives_hostile_unrolls(impala, client, msg, recent):
    if recent:  # within max_policy_lag, so that it is trained on rather than dropped
        msg = {**msg, "version": impala.updates}
    _feed(impala, msg)
    assert _finite(*(p.detach() for p in impala.net.parameters()))
    before = impala.updates
    _feed(impala, _valid_unrolls(impala.updates))
    assert impala.updates == before + 1  # a valid batch still trains
    assert _published_finite(client, impala.keys, impala.keys.weights)


# -- the ES master's fold


@pytest.fixture(scope="module")
def master(client, redis_server):
    m = ESMaster(partial(connect, redis_server.url), _run(client, "es", ES), ES)
    m.start(NEVER)
    yield m
    m.close(NEVER)


def _fold(m: ESMaster, msg: dict) -> None:
    m.fold(Entry("0-1", decode(encode("es.results", msg), m.consumer.schema)))
    if sum(len(p[0]) for p in m.pairs) >= m.cfg.population // 2:
        m.apply()


@hs.HOSTILE
# the master's bounds: a generation's pairs a message, CartPole's 500-step episodes
@given(msg=hs.es_results(4, ES.noise_size, ES_DIM, ES.population // 2, 500), current=st.booleans())
def test_es_master_survives_hostile_results(master, client, msg, current):
    if current:
        msg = {**msg, "generation": master.generation}
    _fold(master, msg)
    assert _finite(master.theta, master.adam.m, master.adam.v, *master.obs_stats())
    assert _published_finite(client, master.keys, es_params(master.keys))
    before = master.generation
    _fold(
        master,
        {
            **msg,
            "generation": master.generation,
            "job": np.zeros(1, np.int64),
            "index": np.zeros(1, np.int64),
            "return_pos": np.ones(1, np.float32),
            "return_neg": np.zeros(1, np.float32),
            "length_pos": np.ones(1, np.int32),
            "length_neg": np.ones(1, np.int32),
            "obs_sum": np.zeros(4),
            "obs_sumsq": np.zeros(4),
            "obs_count": 1.0,
        },
    )
    assert master.generation == before + 1  # a valid result still makes a generation


# -- the weights reader (an actor's WeightStore.load_into)

FITTING = module_arrays(NET())


@pytest.fixture(scope="module")
def reader(client):
    keys = RunKeys(f"hostile-weights-{uuid.uuid4().hex[:8]}")
    return WeightStore(client, keys), NET(), itertools.count(1)


@hs.HOSTILE
@given(msg=hs.weights(FITTING))
def test_weights_reader_survives_hostile_weights(reader, client, msg):
    store, net, versions = reader
    v = next(versions)
    blob = encode_whole(WEIGHTS, msg, v)
    client.hset(store.key, mapping={"version": v, "blob": blob})
    loaded = store.load_into(net, newer_than=v - 1)
    assert loaded in (None, v)
    assert _finite(*(p.detach() for p in net.state_dict().values()))
    v = next(versions)
    store.publish({k: np.full_like(a, 0.5) for k, a in FITTING.items()}, version=v)
    assert store.load_into(net, newer_than=v - 1) == v  # valid weights still load
    assert all(bool((p == 0.5).all()) for p in net.state_dict().values())
    assert torch.isfinite(net(torch.zeros(1, 4))).all()


# -- the metrics reader (qrl train's progress) and qrl status's collection


# the processes whose reports the strategy's reports pose as
ROLES = ("actor", "learner", "replay", "worker", "master")
REPORTERS = [(role, i) for role in ROLES for i in (0, 7)]


@pytest.fixture(scope="module")
def metrics_run(client):
    keys = RunKeys(f"hostile-metrics-{uuid.uuid4().hex[:8]}")
    every_role = {**ALGOS["es"].reports, **ALGOS["apex"].reports}  # the strategy's roles
    return keys, MetricsReader(client, keys, REPORTERS), Progress(every_role)


@hs.HOSTILE
@given(msg=hs.metrics(), source=st.sampled_from(REPORTERS))
def test_metrics_reader_and_progress_survive_hostile_reports(metrics_run, client, msg, source):
    keys, reader, progress = metrics_run
    client.xadd(keys.metrics(*source), {FIELD: encode("metrics", msg)})
    for m in reader.read():
        progress.fold(m)
    row = progress.row()
    assert all(v is None or np.isfinite(v) for v in row.values())
    before = progress.value(UPDATES)
    valid = {"time": 1.0, "values": {"updates": before + 1}}
    client.xadd(keys.metrics("learner", 0), {FIELD: encode("metrics", valid)})
    for m in reader.read():
        progress.fold(m)
    assert progress.value(UPDATES) == before + 1  # a valid report still counts


@hs.HOSTILE
@given(msg=hs.heartbeat())
def test_status_collect_survives_hostile_heartbeats(client, msg):
    keys = RunKeys("hostile-status")
    client.set(keys.proc("x.0"), encode("heartbeat", msg), ex=60)
    client.set(keys.proc("learner.0"), encode("heartbeat", {**msg, "role": "learner", "id": 0}))
    st_ = collect(client, keys)
    assert any(p["role"] == "learner" for p in st_["processes"])  # a valid one still shows
    json.dumps(st_, allow_nan=False)  # plain, finite data (what --json prints)
