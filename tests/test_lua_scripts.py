"""Every Lua script of qrl outside the replay does bounded work whatever a writer with the
run's keys stored: the streams' scripts, the process-number leases, the weight store, the
live config and the learner pool's rendezvous (tests/test_lua_bounded.py has why, the
replay's scripts and the check that every script has cases)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from qrl.algos.impala.config import ImpalaConfig
from qrl.inference import protocol
from qrl.learners import group
from qrl.runtime import ids as ids_module
from qrl.runtime import live
from qrl.runtime.metrics import METRICS, MetricsReader
from qrl.runtime.runs import create_run
from qrl.wire import stream_scripts, streams
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamConsumer, StreamProducer
from qrl.wire.weights import WeightStore
from tests.lua_bounds import (  # the fixtures private and r: a redis-server of this module's own
    HOSTILE,
    WRONG_TYPES,
    bounded,
    fresh_keys,
    private_client,  # noqa: F401
    private_server,  # noqa: F401
)

# -- scripts of other modules (streams, ids, weights)


@pytest.mark.parametrize("wrong", [None, "ids used up", *WRONG_TYPES])
@pytest.mark.parametrize("target", ["stream", "stats"])
def test_stream_add_if_room(private, r, target, wrong):
    keys = fresh_keys()
    name = keys.experience if target == "stream" else keys.stats
    if wrong is None:  # a full stream (plain XADDs) and a counter that is no number
        for _ in range(50):
            r.xadd(keys.experience, {"d": b"x"})
        r.hset(keys.stats, "produced:experience", "abc")
    elif wrong == "ids used up":
        r.xadd(keys.experience, {"d": b"x"}, id="18446744073709551615-18446744073709551615")
        r.hset(keys.stats, "produced:experience", "9223372036854775807")
    else:
        WRONG_TYPES[wrong](r, name)

    def add(c: redis.Redis) -> Any:  # a full stream: dropped after max_wait, not raised
        return StreamProducer(c, keys.experience, 10, keys=keys, max_wait=0.2).add(b"p")

    bounded(private, add)


def _many_pending(c: redis.Redis, k: RunKeys) -> None:
    pipe = c.pipeline(transaction=False)
    for _ in range(20_000):
        pipe.xadd(k.experience, {"d": b"x"})
    pipe.execute()
    for i in range(200):  # 200 fake consumers hold 100 entries each
        c.xreadgroup("qrl", f"fake{i}", {k.experience: ">"}, count=100)


STREAM_STATES: dict[str, Callable[[redis.Redis, RunKeys], Any]] = {
    "no group": lambda c, k: c.xgroup_destroy(k.experience, "qrl"),
    "stream wrong type": lambda c, k: (c.delete(k.experience), c.set(k.experience, "x")),
    "oversized entries, new and pending": lambda c, k: (
        [c.xadd(k.experience, {"d": b"y" * (8 << 20)}) for _ in range(4)]
        + [c.xreadgroup("qrl", "fake", {k.experience: ">"}, count=2)]
    ),
    "20k entries pending for 200 consumers": _many_pending,
    "group id moved past 5k entries": lambda c, k: (
        [c.xadd(k.experience, {"d": b"x"}) for _ in range(5_000)]
        + [c.xgroup_setid(k.experience, "qrl", "$")]
    ),
    "20k idle consumers": lambda c, k: [
        c.xgroup_createconsumer(k.experience, "qrl", f"fake{i}") for i in range(20_000)
    ],  # one at a time: ~2 s
    "dead letters and stats of the wrong type, counters no number": lambda c, k: (
        c.xadd(k.experience, {"d": b"garbage"}),
        c.set(k.deadletter, "x"),
        c.hset(k.stats, mapping={"rejected": "abc", "rejected:experience": "9e99"}),
    ),
}


@pytest.mark.parametrize("state", STREAM_STATES)
def test_stream_read_claim_adopt_prune_ack_and_dead_letter(private, r, state):
    """One read of a consumer runs every script of the consumer side: the group made
    (``ENSURE_GROUP``), its own pending entries, claims, orphans and new entries read and
    screened (``READ``, ``ADOPT``), idle consumers removed (``LEAVE``), bad entries
    dead-lettered (``DEAD_LETTER``) and acknowledged (``ACK``)."""
    keys = fresh_keys()
    r.xgroup_create(keys.experience, "qrl", id="0", mkstream=True)
    STREAM_STATES[state](r, keys)

    def read(c: redis.Redis) -> Any:
        consumer = StreamConsumer(c, keys, keys.experience, METRICS, claim_idle_ms=0)
        consumer.max_bytes = 1 << 16
        return consumer.read(block_ms=0)

    bounded(private, read)
    bounded(private, read)  # and again, with what the first call left


# the processes a follower reads, the most a config allows (4,096 actors: 8,200 numbers)
REPORTERS = [("actor", i) for i in range(ids_module.id_limit(4096))] + [("learner", 0)]


def _junk_metrics(c: redis.Redis, k: RunKeys) -> None:
    pipe = c.pipeline(transaction=False)
    for i in range(3_000):
        pipe.xadd(k.metrics(*REPORTERS[i % 3]), {"d": b"x"})
    pipe.execute()


def _metrics_entry(body: bytes, entry_id: str = "*") -> Callable[[redis.Redis, RunKeys], Any]:
    return lambda c, k: c.xadd(k.metrics("actor", 1), {"d": body}, id=entry_id)


def _metrics_of_type(kind: str) -> Callable[[redis.Redis, RunKeys], Any]:
    return lambda c, k: WRONG_TYPES[kind](c, k.metrics("actor", 1))


def _every_stream(c: redis.Redis, k: RunKeys) -> None:
    pipe = c.pipeline(transaction=False)
    for source in REPORTERS:
        pipe.xadd(k.metrics(*source), {"d": b"x"})
    pipe.execute()


METRICS_STATES: dict[str, Callable[[redis.Redis, RunKeys], Any]] = {
    "3k junk entries": _junk_metrics,
    "oversized entries": lambda c, k: [_metrics_entry(b"y" * (8 << 20))(c, k) for _ in range(4)],
    "ids used up": _metrics_entry(b"x", stream_scripts.LAST_ID),
    "an id ahead of the clock": _metrics_entry(b"x", "99999999999999-0"),
    "an entry in every stream": _every_stream,
    **{f"{kind}, not a stream": _metrics_of_type(kind) for kind in WRONG_TYPES},
}


@pytest.mark.parametrize("state", METRICS_STATES)
def test_metrics_range(private, r, state):
    """A follower of the metrics streams (``RANGE``), from their start and from their newest
    entries, reads on past whatever is there."""
    keys = fresh_keys()
    METRICS_STATES[state](r, keys)

    def follow(c: redis.Redis) -> Any:
        reader = MetricsReader(c, keys, REPORTERS, from_start=True)
        return reader.read(), reader.read(), MetricsReader(c, keys, REPORTERS).read()

    bounded(private, follow)
    bounded(private, follow)  # and again, with what the first calls left


@pytest.mark.parametrize("state", ["no group", "stream wrong type", "many consumers"])
def test_stream_leave(private, r, state):
    keys = fresh_keys()
    stream = keys.experience
    if state == "stream wrong type":
        r.set(stream, "x")
    else:
        r.xgroup_create(stream, "qrl", id="0", mkstream=True)
        if state == "no group":
            r.xgroup_destroy(stream, "qrl")
        else:
            r.xadd(stream, {"d": b"x"})
            for i in range(500):
                r.xreadgroup("qrl", f"fake{i}", {stream: "0"}, count=1)

    def leave(c: redis.Redis) -> Any:
        script = streams.LEAVE.on(c)
        names = [f"fake{i}" for i in range(streams.PRUNE_MAX)]  # as many as a prune gives
        return [script(keys=[stream], args=["qrl", *names]), script(keys=[stream], args=["qrl"])]

    bounded(private, leave)


LEASE_STATES: dict[str, Callable[[redis.Redis, RunKeys], Any]] = {
    "hash": lambda c, k: c.hset(k.lease("actor", 0), "x", "1"),
    "list": lambda c, k: c.rpush(k.lease("actor", 0), "x"),
    "huge value": lambda c, k: c.set(k.lease("actor", 0), "x" * 100_000),
    "other host, no ttl": lambda c, k: c.set(k.lease("actor", 0), "elsewhere:1:tok"),
    "400k fake leases without a ttl": lambda c, k: [
        c.mset({k.lease("actor", i): "elsewhere:1:tok" for i in range(s, s + 10_000)})
        for s in range(0, 400_000, 10_000)
    ],
}


@pytest.mark.parametrize("state", LEASE_STATES)
def test_lease_look_take_and_keep(private, r, state):
    """ids.py's scripts (the API of H4's fix of findings 5 and 11: ``claim_id`` takes the
    configured count, ``LOOK`` reads a chunk of leases, ``KEEP`` keeps or releases)."""
    keys = fresh_keys()
    LEASE_STATES[state](r, keys)

    def claim(c: redis.Redis) -> Any:
        lease = ids_module.claim_id(c, keys, "actor", 4)
        lease.release()
        return lease.ident

    def look(c: redis.Redis) -> Any:
        names = [keys.lease("actor", i) for i in range(64)]
        return ids_module.LOOK(c, names, [10])

    def keep(c: redis.Redis) -> Any:
        key = keys.lease("actor", 0)
        return [
            ids_module.KEEP(c, [key], ["me", 10, "keep"]),
            ids_module.KEEP(c, [key], ["me", 10, "release"]),
        ]

    bounded(private, look)
    assert bounded(private, claim) == 0  # a lease qrl did not write (no TTL) is garbage
    bounded(private, keep)


@pytest.mark.parametrize("version", [*HOSTILE, "wrong type"])
def test_weights_publish(private, r, version):
    keys = fresh_keys()
    if version == "wrong type":
        r.rpush(keys.weights, "x")
    else:
        r.hset(keys.weights, mapping={"version": version, "blob": b"junk"})
    params = {"w": np.zeros(3, np.float32)}
    bounded(private, lambda c: WeightStore(c, keys).publish(params, 1))


@pytest.mark.parametrize("blob", ["junk", "huge", "same length", "wrong type", "version"])
def test_weights_kept(private, r, blob):
    """A writer's blob in place of the publisher's: told apart at once, a huge one with no
    hashing."""
    keys = fresh_keys()
    store = WeightStore(r, keys)
    store.publish({"w": np.zeros(3, np.float32)}, 1)
    mine = r.hget(keys.weights, "blob")
    assert bounded(private, lambda c: store.kept(every_s=0)) == 1
    if blob == "wrong type":
        r.delete(keys.weights)
        WRONG_TYPES["list"](r, keys.weights)
    elif blob == "version":
        r.hset(keys.weights, "version", "9" * 100_000)
    else:
        other = {"junk": b"j", "huge": b"x" * (256 << 20), "same length": b"x" * len(mine)}
        r.hset(keys.weights, "blob", other[blob])
    assert bounded(private, lambda c: store.kept(every_s=0)) == 0


def _live(mapping: dict[str, Any]) -> Callable[[redis.Redis, RunKeys], Any]:
    return lambda c, k: c.hset(k.config_live, mapping=mapping)


def _wrong(kind: str) -> Callable[[redis.Redis, RunKeys], Any]:
    return lambda c, k: WRONG_TYPES[kind](c, k.config_live)


LIVE_STATES: dict[str, Callable[[redis.Redis, RunKeys], Any]] = {
    "huge version": _live({"version": "9" * 100_000}),
    "huge values": _live({"version": "1", "values": "x" * 4_000_000}),
    "100k fields": _live({f"f{i}": "x" for i in range(100_000)}),
    **{f"version {v}": _live({"version": v, "values": "{}"}) for v in HOSTILE},
    **{f"a {kind}": _wrong(kind) for kind in WRONG_TYPES},
}


@pytest.mark.parametrize("state", LIVE_STATES)
def test_live_config_read_and_set(private, r, state):
    """live.py's scripts over whatever the live-config hash holds: a role's poll (``READ``,
    run by every role's stop-flag check) and ``qrl run set``'s compare-and-set (``SET``),
    which replaces what it cannot read."""
    keys = fresh_keys()
    create_run(r, keys, "impala", ImpalaConfig())
    LIVE_STATES[state](r, keys)
    bounded(private, lambda c: live._read(live.READ.on(c), keys, b""))
    _, cfg = bounded(private, lambda c: live.set_live(c, keys, ImpalaConfig, {"lr": 1e-4}))
    assert cfg.lr == 1e-4


# -- the learner pool's rendezvous (qrl/learners/group.py)


def _gen(k: RunKeys, what: str = "gen", gen: str = "") -> str:
    return group._key(k, what, gen)


def _huge_list(c: redis.Redis, key: str) -> None:
    for _ in range(20):
        c.rpush(key, *(["x"] * 10_000))


GROUP_STATES: dict[str, Callable[[redis.Redis, RunKeys], Any]] = {
    "gen a 200k list": lambda c, k: _huge_list(c, _gen(k)),
    "gen a huge string": lambda c, k: c.set(_gen(k), "ab." + "1" * 4_000_000),
    "joined a 100k-field hash": lambda c, k: (
        c.set(_gen(k), "ab.2"),
        c.hset(_gen(k, "joined", "ab.2"), mapping={f"f{i}": "x" for i in range(100_000)}),
    ),
    "joined a 200k list, addr huge": lambda c, k: (
        c.set(_gen(k), "ab.2"),
        _huge_list(c, _gen(k, "joined", "ab.2")),
        c.set(_gen(k, "addr", "ab.2"), "x" * 4_000_000),
    ),
    **{
        f"joined {v[:20]}": lambda c, k, v=v: (
            c.set(_gen(k), "ab.2"),
            c.set(_gen(k, "joined", "ab.2"), v),
        )
        for v in HOSTILE
    },
}


@pytest.mark.parametrize("state", GROUP_STATES)
def test_learner_group_join_and_abandon(private, r, state):
    """The pool's scripts over whatever the rendezvous keys hold: joining (``JOIN``: a new
    generation where the current one is not a valid one of this size) and giving up
    (``ABANDON``, which unlinks, so a planted huge value costs Redis nothing)."""
    keys = fresh_keys()
    GROUP_STATES[state](r, keys)
    gen, rank = bounded(private, lambda c: group._enter(c, keys, 2, 10))
    assert rank in (0, 1)
    names = [_gen(keys), _gen(keys, "joined", "ab.2"), _gen(keys, "addr", "ab.2")]
    bounded(private, lambda c: group.ABANDON(c, names, ["", "", 2]))


# -- central inference's request queue (qrl/inference/protocol.py)


def _many_requests(c: redis.Redis, key: str) -> None:
    pipe = c.pipeline(transaction=False)
    for _ in range(100_000):
        pipe.rpush(key, b"x" * 100)
    pipe.execute()


REQUEST_STATES: dict[str, Callable[[redis.Redis, str], Any]] = {
    "100k requests": _many_requests,
    "oversized requests": lambda c, k: [c.rpush(k, b"y" * (8 << 20)) for _ in range(4)],
    **WRONG_TYPES,
}


@pytest.mark.parametrize("state", REQUEST_STATES)
def test_inference_request_pop(private, r, state):
    """A server pops at most its count, and a planted huge request costs it only its size."""
    key = fresh_keys().key("inference:requests:0")
    if state in WRONG_TYPES:
        r.delete(key)
    REQUEST_STATES[state](r, key)
    got = bounded(private, lambda c: protocol.pop(c, [key], 64, 1 << 16, 8))
    assert len(got) <= 64


def _trial(fill: Callable[[redis.Redis, list[str]], Any]) -> Callable[..., Any]:
    """A state of the first trial's lease, freed time and score keys."""

    def state(c: redis.Redis, pop: Any) -> Any:
        return fill(c, [pop.key(f"{pop.name}-t0", k) for k in ("lease", "freed", "score")])

    return state


POPULATION_STATES: dict[str, Callable[..., Any]] = {
    "huge values": _trial(lambda c, ks: [c.set(k, "w" * 4_000_000) for k in ks]),
    "a lease of no end": _trial(lambda c, ks: c.set(ks[0], "w")),
    **{
        f"a {kind}": _trial(lambda c, ks, kind=kind: [WRONG_TYPES[kind](c, k) for k in ks])
        for kind in WRONG_TYPES
        if kind != "string"
    },
}


@pytest.mark.parametrize("state", POPULATION_STATES)
def test_population_take_and_hold(private, r, state):
    """qrl/pbt/population.py's scripts touch one trial's lease (and freed time) each, and a
    huge value costs them no more than its length check."""
    from qrl.pbt.population import Population

    pop = Population(r, fresh_keys().run)
    POPULATION_STATES[state](r, pop)
    trials = [f"{pop.name}-t{i}" for i in range(64)]

    def claim(c: redis.Redis) -> Any:
        got = Population(c, pop.name).claim("w", 60, trials)
        assert got is None or got in trials
        return got

    bounded(private, claim)
    bounded(private, lambda c: Population(c, pop.name).renew(trials[0], "w", 60))
    bounded(private, lambda c: Population(c, pop.name).release(trials[0], "w"))
    bounded(private, lambda c: Population(c, pop.name).holders(trials))
    bounded(private, lambda c: Population(c, pop.name).scores(trials))


def test_no_script_examines_more_than_its_bound_whatever_its_argv_asks(private, r):
    """A role's user may run its role's scripts (by SHA) with arguments of its own: a call that
    asks for 10^9 entries, requests or buckets gets each script's bound, not a loop that
    holds Redis for minutes (before, each looped as long as the stream or its count)."""
    from qrl.wire.scripts import every_script

    lua, keys = every_script(), fresh_keys()
    stream, other, n = keys.metrics("actor", 0), keys.deadletter, stream_scripts.MAX_ENTRIES + 1000
    pipe = r.pipeline(transaction=False)
    for _ in range(n):
        pipe.xadd(stream, {"d": "x"})
        pipe.xadd(other, {"d": "x"})
    pipe.execute()
    r.xgroup_create(stream, "qrl", "0")
    r.xgroup_create(other, "qrl", "$")  # every entry delivered, none pending: orphans
    huge = 10**9

    def call(name: str, keys_: list[str], args: list) -> Any:
        return bounded(private, lambda c: lua[name].on(c)(keys_, args))

    *_, rows = call("metrics.range", [stream], [huge, huge, 10**18, 0, "0-0"])
    assert len(rows) == 1000  # MetricsReader.COUNT
    _, out = call("streams.read", [stream], ["me", ">", "", huge, huge, 1000, 10**18])
    assert len(out) == stream_scripts.MAX_ENTRIES
    _, adopted = call("streams.adopt", [other], ["me", "-", huge, huge, 1000])
    assert adopted == stream_scripts.MAX_ENTRIES
    lists = [keys.key(f"requests:{i}") for i in range(2)]
    r.rpush(lists[0], *[b"x"] * 100)
    out, *_ = call("inference.pop", lists, [huge, huge, huge])
    # (list, request) pairs: 32 of one list at most (EACH of an actor's MAX_BATCHES)
    assert len(out) == 2 * protocol.EACH * protocol.MAX_BATCHES == 2 * 32
    prio, data = keys.replay_priorities, keys.replay_data
    args = [0.6, 1e-6, 2**0.25, huge, np.zeros(4).tobytes(), 16]
    assert call("replay.sample_proportional", [prio, data], args)[0] == 0  # 1,024 buckets
    frames = [prio, data, keys.replay_index, keys.replay_frames]
    assert call("frames.sample_proportional", frames, [*args[:5], 100, 16])[0] == 0
