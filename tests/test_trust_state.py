"""What a writer with a run's keys can do to its weights, metrics, process numbers and stop
flag (issue 28, findings 3, 5, 6, 10, 11), and Redis out of memory: against real
redis-servers, each attack is logged, repaired or ridden out, never fatal."""

from __future__ import annotations

import itertools
import logging
import threading

import pytest
import redis
import torch

from qrl.algos import ALGOS
from qrl.runtime.control import StopFlag, request_stop
from qrl.runtime.ids import LEASE_TTL, Lease, claim_id, id_limit
from qrl.runtime.metrics import MetricsReader, report
from qrl.runtime.roles import ENV_STEPS
from qrl.runtime.runlog import MAX_COUNT, MAX_IDS, Progress, RunLog
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.chunks import encode_whole
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.weights import MAX_AHEAD, MAX_VERSION, WEIGHTS, WeightStore, module_arrays
from tests.helpers import make_actor, make_learner, wait_until


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2)


# -- finding 3: a huge weights version


def test_a_far_ahead_weights_version_is_garbage_overwritten_not_adopted(r, keys):
    store, reader = WeightStore(r, keys), WeightStore(r, keys)
    assert store.publish(_net(), version=5) == 5
    assert reader.fetch().version == 5
    for huge in (MAX_VERSION, MAX_VERSION - 1, 6 + MAX_AHEAD + 1):
        # the attacker's blob is valid: readers take it, then the learner overwrites it
        blob = encode_whole(WEIGHTS, {"params": module_arrays(_net(1))}, huge)
        r.hset(keys.weights, mapping={"version": huge, "blob": blob})
        assert store.publish(_net(), version=6) == 6  # its own count, not huge + 1
        assert r.hget(keys.weights, "version") == b"6"
        w = reader.fetch(newer_than=huge)  # a reader that took the garbage version
        assert w is not None and w.version == 6  # sees the key went back, loads it


def test_a_learner_never_resumes_from_a_far_ahead_version(r, keys, redis_server):
    from qrl.algos.impala.config import ImpalaConfig
    from qrl.runtime.runs import create_run

    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=4, unroll=10)
    create_run(r, keys, "impala", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    WeightStore(r, keys).publish(lrn.rule.published(), version=MAX_VERSION - 1)  # valid blob
    lrn.start(lambda: False)
    try:
        assert lrn.updates == 0 and lrn.publisher.weights.version() == 0
    finally:
        lrn.close(lambda: True)


# -- finding 5: keys of the wrong type


def test_wrong_type_control_metrics_and_lease_keys_are_repaired(r, keys, caplog):
    r.set(keys.control, "x")
    r.hset(keys.metrics("actor", 0), "a", 1)
    r.hset(keys.lease("actor", 0), "a", 1)
    with caplog.at_level(logging.WARNING):
        stop = StopFlag(r, keys, interval=0, signals=False)
        assert not stop() and not stop()
        reader = MetricsReader(r, keys, [("actor", 0)])
        report(r, keys, "actor", 0, steps=1)
        assert [m["values"]["steps"] for m in reader.read()] == [1]
        lease = claim_id(r, keys, "actor", count=2)
        assert lease.ident == 0 and r.type(keys.lease("actor", 0)) == b"string"
        lease.release()
        r.set(keys.control, "x")
        request_stop(r, keys)
        assert StopFlag(r, keys, interval=0, signals=False)()
    assert r.type(keys.metrics("actor", 0)) == b"stream" and r.type(keys.control) == b"hash"
    repaired = [m for m in caplog.messages if "wrong type" in m]  # once per key
    assert [m.split(" ")[0] for m in repaired] == [
        keys.control,
        keys.metrics("actor", 0),
        keys.lease("actor", 0),
    ], repaired


# -- finding 11: fake leases


def _commands(r) -> int:
    """How many commands Redis has run, its scripts' own included: the work asked of it."""
    return sum(stat["calls"] for stat in r.info("commandstats").values())


def test_fake_leases_neither_slow_claims_nor_give_numbers_past_the_limit(r, keys, caplog):
    pipe = r.pipeline(transaction=False)
    for i in range(20_000):  # no TTL: not a lease qrl wrote
        pipe.set(keys.lease("actor", i), f"elsewhere:{i}:x")
    pipe.execute()
    before = _commands(r)
    lease = claim_id(r, keys, "actor", count=4)
    assert lease.ident == 0
    assert _commands(r) - before < 1000  # it looked at its few numbers, not 20,000 leases
    assert 0 < r.ttl(keys.lease("actor", 0)) <= LEASE_TTL
    # live-looking leases on every number up to the limit: no number past it is handed out
    for i in range(id_limit(4)):
        r.set(keys.lease("actor", i), f"elsewhere:{i}:x", ex=LEASE_TTL)
    lease.release()
    got: list[Lease] = []
    t = threading.Thread(target=lambda: got.append(claim_id(r, keys, "actor", 4)))
    with caplog.at_level(logging.WARNING, "qrl.runtime.ids"):
        t.start()
        wait_until(lambda: "waiting for one to be free" in caplog.text, "the claim to wait", 30)
    assert not got
    r.delete(keys.lease("actor", 3))
    t.join(10)
    assert [lease.ident for lease in got] == [3]
    got[0].release()


# -- finding 10: fake metrics ids


def test_fake_metrics_ids_are_bounded_and_sums_clamped(r, keys, tmp_path):
    progress = Progress(ALGOS["apex"].reports)
    for ident in range(MAX_IDS + 500):
        values = {"steps": 1e15, "steps_per_s": 1.0}
        progress.fold({"role": "actor", "id": ident, "time": 1.0, "values": values})
    assert all(len(fold.latest) <= MAX_IDS for fold in progress.folds["actor"])
    assert progress.value(ENV_STEPS) == MAX_COUNT
    with RunLog(tmp_path) as out:
        assert out.write(progress, force=True)


def test_a_failing_sink_does_not_end_the_run_log(tmp_path, caplog):
    class Broken:
        def log(self, scalars, step):
            raise ValueError("Value out of range")

        def close(self):
            pass

    progress = Progress(ALGOS["apex"].reports)
    progress.fold({"role": "actor", "id": 0, "time": 1.0, "values": {"steps": 10}})
    with caplog.at_level(logging.WARNING), RunLog(tmp_path) as out:
        out._sinks.append(Broken())
        assert out.write(progress, force=True) and out.write(progress, force=True)
    assert len([m for m in caplog.messages if "Value out of range" in m]) == 1


# -- finding 6: Redis out of memory


@pytest.fixture
def tight():
    """A private redis-server and a qrl client of it; ``full(True)`` fills it to its
    ``maxmemory`` (noeviction: every write then fails with OOM), ``full(False)`` frees it."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)  # plain redis-py: no waiting on OOM
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", admin.info("memory")["used_memory"] + 4_000_000)

        def full(on: bool) -> None:
            if not on:
                admin.delete(*admin.keys("fill:*"))
                return
            n = itertools.count()
            for size in (100_000, 10_000, 1_000, 100, 10):  # to the last bytes
                try:
                    while True:
                        admin.set(f"fill:{next(n)}", b"x" * size)
                except redis.OutOfMemoryError:
                    pass

        yield connect(server.url, deadline=30), full
        admin.close()


def _waits(caplog) -> int:
    """How many times a write found Redis out of memory and began to wait (one warning each)."""
    return sum("out of memory" in m and "retrying" in m for m in caplog.messages)


def _freed_once_waiting(full, caplog, waits: int) -> threading.Thread:
    """Free the memory once the log says a write waits for it (the ``waits``-th time)."""

    def free() -> None:
        wait_until(lambda: _waits(caplog) >= waits, "a write to wait for memory", 30)
        full(False)

    t = threading.Thread(target=free)
    t.start()
    return t


def test_writes_wait_out_redis_out_of_memory(tight, caplog):
    client, full = tight
    keys = RunKeys("oom")
    store = WeightStore(client, keys)
    with caplog.at_level(logging.WARNING, "qrl.wire.connection"):
        for waits, write in enumerate(
            (
                lambda: store.publish(_net(), version=1),
                lambda: claim_id(client, keys, "actor", count=2).release(),
                lambda: client.xadd(keys.experience, {"x": 1}),
            ),
            start=1,
        ):
            full(True)
            freeing = _freed_once_waiting(full, caplog, waits)
            write()  # waited for the memory (freed only then), then done
            freeing.join()
            assert _waits(caplog) == waits
    assert store.version() == 1 and client.xlen(keys.experience) == 1


def test_a_metrics_report_is_skipped_while_redis_is_out_of_memory(tight, caplog):
    client, full = tight
    keys = RunKeys("oom")
    full(True)
    with caplog.at_level(logging.WARNING):
        # they return while Redis stays full: skipped (a wait would end only in an error)
        report(client, keys, "actor", 0, steps=1)
        report(client, keys, "actor", 0, steps=2)
    oom = [m for m in caplog.messages if "out of memory" in m]
    assert len(oom) == 1 and "metrics report skipped" in oom[0], oom  # not "retrying"
    full(False)
    report(client, keys, "actor", 0, steps=3)
    assert client.xlen(keys.metrics("actor", 0)) == 1


def _throttled(actor, steps: int, looks: int = 20) -> bool:
    """Whether the actor's rate limit holds it, at ``steps`` env steps of its own, through
    ``looks`` looks at the learner's progress (it asks whether to stop at each; told to after
    the last)."""
    asked = itertools.count(1)
    return not actor.sink.throttle(steps, actor.weights, lambda: next(asked) > looks)


def test_apex_rate_limit_trusts_neither_an_injected_version_nor_stats(r, keys):
    from qrl.algos.apex.config import ApexConfig
    from qrl.runtime.runs import create_run

    cfg = ApexConfig(actors=2, envs_per_actor=2, learning_starts=100, steps_per_update=10)
    create_run(r, keys, "apex", cfg)
    actor = make_actor("apex", r, keys, cfg)
    WeightStore(r, keys).publish(actor.weights.net, 0)
    assert actor.weights.refresh()
    steps = 150  # past learning_starts, the learner at update 0: held
    assert _throttled(actor, steps)
    r.hset(keys.weights, "version", MAX_VERSION - 1)  # no weights of that version: ignored
    assert _throttled(actor, steps)
    r.hset(keys.stats, "env_steps", -(10**15))  # the run's count lowered: its own still holds
    assert _throttled(actor, steps)
    for garbage in ("x", 2**63 - 1):  # not a count, one that overflows: reset
        r.hset(keys.stats, "env_steps", garbage)
        assert _throttled(actor, steps)
    r.hset(keys.stats, "env_steps", 10**15)  # raised: it counts its fair share, not that
    steps = 10
    assert not _throttled(actor, steps)
    r.delete(keys.stats)
    r.set(keys.stats, "x")  # the wrong type: repaired
    assert not _throttled(actor, steps) and r.type(keys.stats) == b"hash"


def test_a_wrong_type_key_a_user_may_not_delete_is_read_as_nothing(r, keys, redis_server):
    r.execute_command("ACL", "SETUSER", "nodel-h4", "on", ">pw-h4", "~*", "+@all", "-del")
    try:
        url = redis_server.url.replace("redis://", "redis://nodel-h4:pw-h4@")
        client = redis.Redis.from_url(url)
        r.set(keys.control, "x")
        assert not StopFlag(client, keys, interval=0, signals=False)()
        assert r.get(keys.control) == b"x"
        client.close()
    finally:
        r.execute_command("ACL", "DELUSER", "nodel-h4")
