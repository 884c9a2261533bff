"""A second writer of a weights key: when the key holds a newer version than the learner's
own, the learner publishes above it and carries on from there (one warning); garbage in the
key (a version that is not a number, a blob that does not decode, a key that is not a hash)
crashes neither learners nor readers. IMPALA, ES and Ape-X learners against a real Redis."""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import numpy as np
import pytest
import torch

from qrl.algos.apex.config import ApexConfig
from qrl.algos.es.config import ESConfig
from qrl.algos.es.keys import es_params, es_results
from qrl.algos.es.strategy import PolicySpec
from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.learners.es import ESMaster
from qrl.replay.role import make_replay
from qrl.rl.envspec import EnvSpec
from qrl.runtime.loop import run_role
from qrl.runtime.runs import create_run
from qrl.wire.codec import encode
from qrl.wire.connection import connect
from qrl.wire.streams import FIELD
from qrl.wire.weights import WeightStore, module_arrays
from tests.helpers import es_payload, fill_replay, impala_unrolls, make_learner, wait_until

GARBAGE = [  # what the weights hash may hold after someone else wrote it
    {"version": "garbage", "blob": b"junk"},
    {"version": "1e400", "blob": b"junk"},
    {"version": "nan", "blob": b"junk"},
    {"version": str(2**62), "blob": b"junk"},
    {"version": "-7"},
]


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_publish_goes_above_a_newer_version_and_warns_once(r, keys, caplog):
    ours, theirs, reader = WeightStore(r, keys), WeightStore(r, keys), WeightStore(r, keys)
    assert ours.publish(_net(0), version=3) == 3
    assert theirs.publish(_net(1), version=10) == 10  # a second learner
    with caplog.at_level(logging.WARNING, "qrl.wire.weights"):
        assert ours.publish(_net(0), version=4) == 11
        assert ours.publish(_net(0), version=11) == 12  # taken already: above it again
    warned = [rec for rec in caplog.records if "another writer" in rec.getMessage()]
    assert len(warned) == 1 and "holds version 10" in warned[0].getMessage()
    w = reader.fetch()
    assert w.version == 12 == reader.version()  # the blob says 12 too: readers accept it
    mine = module_arrays(_net(0))
    assert all(np.array_equal(w.params[k], mine[k]) for k in mine)


def test_garbage_in_the_weights_key_is_ignored_by_readers_and_overwritten(r, keys):
    store = WeightStore(r, keys)
    actor = _net(1)
    for n, garbage in enumerate(GARBAGE):
        r.delete(keys.weights)
        r.hset(keys.weights, mapping=garbage)
        assert store.version() == -1 and store.fetch() is None
        assert store.load_into(actor) is None
        assert store.publish(_net(0), version=n) == n  # overwritten, not refused
        assert store.version() == n and store.fetch().version == n
    r.delete(keys.weights)
    r.set(keys.weights, b"not a hash")  # the wrong Redis type
    assert store.version() == -1 and store.fetch() is None and store.load_into(actor) is None
    assert store.publish(_net(0), version=0) == 0 and store.fetch().version == 0


def test_impala_learner_publishes_above_a_second_writer(r, keys, redis_server):
    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=4, unroll=10)
    create_run(r, keys, "impala", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    msg = {FIELD: encode("impala.unrolls", impala_unrolls(cfg, r, keys))}

    def train_once() -> None:  # the learner's loop, one update at a time
        done, deadline = lrn.updates, time.monotonic() + 30
        r.xadd(trajectories(keys), msg)
        while lrn.updates == done and time.monotonic() < deadline:
            assert lrn.step(lambda: False)
        # its publication (on a thread of its own) done, and carried on from where it went
        lrn.updates = lrn.publisher.settled(lrn.updates)

    lrn.start(lambda: False)
    try:
        train_once()
        assert lrn.updates == 1 == lrn.publisher.weights.version()
        WeightStore(r, keys).publish(_net(5), version=50)  # someone else's weights, newer
        train_once()  # no ValueError: published above them
        assert lrn.updates == 51 == lrn.publisher.weights.version()
        for garbage in GARBAGE[:2]:
            r.hset(keys.weights, mapping=garbage)
            train_once()
            assert (
                lrn.publisher.weights.version() == lrn.updates
                and lrn.publisher.weights.fetch() is not None
            )
        assert lrn.updates == 53
    finally:
        lrn.close(lambda: True)


def test_a_learner_publishes_over_garbage_at_its_own_version_as_it_starts(r, keys, redis_server):
    """Junk at version 0 before a fresh learner starts: its actors wait for weights that
    decode, so it publishes above the junk instead of taking the version as its own (a CI run
    of the hostile-writes test saw Ape-X's actors wait the whole job)."""
    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=4, unroll=10)
    create_run(r, keys, "impala", cfg)
    for junk in (
        {"blob": b"junk"},
        {
            "blob": encode(
                "weights",
                {"version": 0, "params": {"other": np.zeros(3, np.float32)}, "meta": None},
            )
        },
    ):
        r.delete(keys.weights)
        r.hset(keys.weights, mapping={"version": "0", **junk})  # decodes, or fits no net
        lrn = make_learner(redis_server.url, keys, cfg)
        lrn.start(lambda: False)
        try:
            w = WeightStore(r, keys).fetch()
            assert w is not None and w.version == lrn.updates == 1
            assert lrn.publisher.weights.load_into(lrn.net) == 1  # what the actors take: it fits
        finally:
            lrn.close(lambda: True)


def test_a_learner_waiting_for_data_publishes_again_over_a_writers_blob(r, keys, redis_server):
    """A writer's blob under the learner's version once it has started, with nothing new to
    publish: readers reject that version once and wait for another, and the learner waits
    for their data (a CI run of the hostile-writes test saw Ape-X stall so for the whole
    job). The learner sees its blob gone and publishes again as a new version."""
    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=4, unroll=10)
    create_run(r, keys, "impala", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    lrn.start(lambda: False)
    try:
        started = lrn.updates
        r.hset(keys.weights, "blob", b"junk")
        actor = WeightStore(r, keys)
        assert actor.fetch() is None  # rejected, and this version is not fetched again
        deadline = time.monotonic() + 10
        while (w := actor.fetch()) is None and time.monotonic() < deadline:
            lrn.step(lambda: False)  # no data comes
        assert w is not None and w.version == lrn.updates == started + 1
    finally:
        lrn.close(lambda: True)


def test_es_master_publishes_above_a_second_writer_and_survives_garbage(r, keys, redis_server):
    cfg = ESConfig(population=4, noise_size=10_000, obs_norm=False)
    create_run(r, keys, "es", cfg)
    master = ESMaster(partial(connect, redis_server.url), keys, cfg)

    def generation_done(gen: int) -> None:  # the master's loop, one generation
        r.xadd(es_results(keys), {FIELD: es_payload(gen, [10, 20], [1.0, 0.0], [0.0, 2.0])})
        deadline = time.monotonic() + 30
        while master.generation == gen and time.monotonic() < deadline:
            assert master.step(lambda: False)

    master.start(lambda: False)
    other = ESMaster(partial(connect, redis_server.url), keys, cfg)
    other.generation = 20
    other.publish()  # a second master
    generation_done(0)  # no ValueError: published above it
    assert master.generation == 21 == master.store.version()
    assert master.store.fetch().version == 21
    # the generation it now works on is the one it published: its results count
    generation_done(21)
    assert master.generation == 22 and master.stale == 0
    # a restarted master does not crash on garbage or on parameters that do not fit
    unfit = {"theta": np.zeros(3, np.float32), "adam_m": np.zeros(3), "adam_v": np.zeros(3)}
    WeightStore(r, keys, es_params(keys)).publish(unfit, version=30, meta={"adam_t": "x"})
    again = ESMaster(partial(connect, redis_server.url), keys, cfg)
    assert not again.resumed and again.generation == 0
    again.start(lambda: False)
    assert again.generation == 31 == again.store.version()
    for garbage in GARBAGE:
        r.delete(es_params(keys))
        r.hset(es_params(keys), mapping=garbage)
        assert not ESMaster(partial(connect, redis_server.url), keys, cfg).resumed


def test_apex_learner_publishes_above_a_second_writer(r, keys, redis_server):
    cfg = ApexConfig(learning_starts=100, publish_every=5)
    create_run(r, keys, "apex", cfg)
    replay = make_replay(r, keys, cfg)
    fill_replay(replay, np.zeros((200, 4), np.float32))
    lrn = make_learner(redis_server.url, keys, cfg)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_role(lrn, r, keys, 0, stop.is_set)
        except BaseException as e:  # noqa: BLE001 - the test reports whatever it was
            errors.append(e)

    def running() -> None:
        assert not errors, errors

    def above(probe, what: str, bound: int) -> None:
        wait_until(
            probe, f"{what} above {bound}", until=lambda v: v > bound, every=0.05, between=running
        )

    t = threading.Thread(target=run)
    t.start()
    try:
        above(lambda: lrn.updates, "updates", 9)
        WeightStore(r, keys).publish(module_arrays(lrn.net), version=1000)
        above(lrn.publisher.weights.version, "the weights' version", 1000)
        r.hset(keys.weights, "version", "garbage")
        above(lrn.publisher.weights.version, "the weights' version", 1001)
    finally:
        stop.set()
        t.join(60)
    assert not errors and not t.is_alive()
    assert lrn.updates > 1001 and lrn.publisher.weights.version() == lrn.updates
    assert lrn.publisher.weights.fetch().version == lrn.updates


def test_qrl_train_evaluation_skips_parameters_that_do_not_fit(r, keys):
    from qrl.algos import ALGOS
    from qrl.jobs.train import Evaluator

    cfg = ESConfig(population=4, noise_size=10_000)
    evaluator = Evaluator(ALGOS["es"], cfg, episodes=1)
    store = WeightStore(r, keys, es_params(keys))
    store.publish({"theta": np.zeros(3, np.float32)}, version=1)  # decodes, does not fit
    with pytest.raises(ValueError, match="do not fit"):  # logged by qrl train, not fatal
        evaluator(r, keys)
    assert evaluator.last is None and evaluator(r, keys) is None  # not tried again
    spec = PolicySpec.for_env(EnvSpec.of(cfg.env), cfg.hidden)
    good = {
        "theta": np.zeros(spec.dim, np.float32),
        "obs_mean": np.zeros(spec.obs_dim, np.float32),
        "obs_std": np.ones(spec.obs_dim, np.float32),
    }
    store.publish(good, version=2)
    assert evaluator(r, keys) is not None and evaluator.last.version == 2
