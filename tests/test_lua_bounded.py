"""Every Lua script of qrl does bounded work, whatever a writer with the run's keys stored.

A Lua script blocks the whole redis-server while it runs (every client, every run), and one
that wrote before it looped cannot be killed (``SCRIPT KILL`` answers ``UNKILLABLE``). So
each script is driven here with hostile stored state (meta fields, counters, priorities,
lease keys, keys of the wrong type: huge, negative, non-numeric) and each call must return,
or raise a clean Redis error, within :data:`LIMIT` while another client's PINGs answer.
The replay's scripts must not even raise: they repair what they find and carry on.

The scripts run on a private redis-server (one per module): an unbounded one would wedge
the session's for the other tests. A call that overruns gets that server killed and
restarted. ``test_every_script_is_covered`` fails when a new script appears in ``qrl/``
without a case here.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry

from qrl.algos.impala.config import ImpalaConfig
from qrl.replay.frames import FrameBatch, FrameLayout, FrameReplay, pack_frames
from qrl.replay.store import PrioritizedReplay
from qrl.runtime import ids as ids_module
from qrl.runtime import live
from qrl.runtime.metrics import METRICS
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire import stream_scripts, streams
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamConsumer, StreamProducer
from qrl.wire.weights import WeightStore
from tests.helpers import LAYOUT, make_records

LIMIT = 1.0  # seconds a call may take (the unbounded loops take seconds to forever)
PING_LIMIT = LIMIT  # seconds another client's PING may wait meanwhile (a noisy machine)
CAP = 100
FRAMES = FrameLayout((4, 6, 6), "uint8", 6)

# what a hostile writer stores in a number's place
HOSTILE = [
    "4000000",
    "9000000",
    "1000000000000000",
    "9007199254740993",
    "99999999999999999999999",
    "9223372036854775807",
    "-1",
    "-4000000",
    "-1000000000000000",
    "-9223372036854775808",
    "4e6",
    "-4e6",
    "1e308",
    "inf",
    "-inf",
    "nan",
    "1.5",
    "0x10",
    " 7",
    "",
    "abc",
    "x" * 1000,
]
_runs = itertools.count()


class Private:
    """A private redis-server that can be killed and restarted when a script wedges it."""

    def __init__(self) -> None:
        self.server = EmbeddedRedis().start()

    def client(self, timeout: float | None = None) -> redis.Redis:
        # no retries: a timed-out script call must not be sent again once the server is free
        return redis.Redis(
            host=self.server.host,
            port=self.server.port,
            socket_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def restart(self) -> None:
        if self.server.proc is not None:
            self.server.proc.kill()  # busy in a script: SIGTERM would wait for it
        self.server.stop()
        self.server = EmbeddedRedis().start()


@pytest.fixture(scope="module")
def private():
    p = Private()
    yield p
    p.server.stop()


@pytest.fixture
def r(private) -> redis.Redis:
    """A client of the private server (shadows conftest's ``r``)."""
    client = private.client()
    yield client
    client.close()


def fresh_keys() -> RunKeys:
    return RunKeys(f"b{next(_runs)}")


def bounded(private: Private, call: Callable[[redis.Redis], Any]) -> Any:
    """``call(client)``'s result or the Redis error it raised; fails unless it came within
    :data:`LIMIT` while PINGs from another client answered within :data:`PING_LIMIT`."""
    client = private.client(timeout=LIMIT)
    pinger = private.client(timeout=PING_LIMIT)
    pinger.ping()
    pings: list[Any] = []
    stop = threading.Event()

    def ping() -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                pinger.ping()
                pings.append(time.monotonic() - t)
            except redis.RedisError as e:
                pings.append(e)
            stop.wait(0.02)

    thread = threading.Thread(target=ping, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        out = call(client)
    except (redis.TimeoutError, redis.ConnectionError) as e:
        out = e
    except redis.ResponseError as e:  # a clean error, not counted as wedging
        out = e
    elapsed = time.monotonic() - start
    stop.set()
    thread.join()
    slow = [p for p in pings if not isinstance(p, float) or p > PING_LIMIT]
    wedged = elapsed > LIMIT or isinstance(out, (redis.TimeoutError, redis.ConnectionError))
    client.close()
    pinger.close()
    if wedged or slow:
        private.restart()
    assert not wedged, f"the call took {elapsed:.2f}s ({out!r})"
    assert not slow, f"another client's PING: {slow[:3]}"
    return out


def frame_batch(n: int, seed: int = 0) -> FrameBatch:
    """``n`` transitions of two env slots over small distinct frames."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 255, (n, 2 * 4, 6, 6), dtype=np.uint8)
    slots = np.arange(n) % 2
    fields = pack_frames(frames[:, :4], frames[:, 4:], slots)
    return FrameBatch(
        fields["frames"],
        fields["counts"],
        fields["refs"],
        rng.integers(0, 6, n).astype(np.int32),
        np.ones(n, np.float32),
        np.full(n, 0.9, np.float32),
    )


def plain(client: redis.Redis, keys: RunKeys, mode: str = "rank") -> PrioritizedReplay:
    return PrioritizedReplay(client, keys, LAYOUT, CAP, mode=mode, seed=0)  # type: ignore[arg-type]


def framed(client: redis.Redis, keys: RunKeys, mode: str = "rank") -> FrameReplay:
    return FrameReplay(client, keys, FRAMES, CAP, mode=mode, seed=0)


def insert(replay: PrioritizedReplay, n: int, batch: str = "") -> int:
    if isinstance(replay, FrameReplay):
        return replay.insert(frame_batch(n), np.ones(n), batch_id=batch)
    return replay.insert(make_records(range(n)), np.ones(n), batch_id=batch)


def still_works(r: redis.Redis, keys: RunKeys, make: Callable) -> None:
    """After whatever the hostile state did: the replay inserts, evicts within its capacity,
    samples and reports, and its meta holds whole numbers again."""
    replay = make(r, keys)
    for b in range(3):
        insert(replay, 60, f"after{b}")
    stats = replay.stats()
    assert 0 < stats["size"] <= 2 * CAP + 60  # what was there before may be kept once
    s = replay.sample(16)
    assert s is not None and len(s.ids) > 0
    meta = r.hgetall(keys.replay_meta)
    hi, lo = int(meta[b"hi"]), int(meta[b"lo"])
    assert 0 <= lo <= hi and hi - lo <= CAP


# -- the replay's insert scripts: meta fields


REPLAYS = {"plain": plain, "frames": framed}


@pytest.mark.parametrize("kind", REPLAYS)
def test_insert_after_a_huge_hi_is_bounded(private, r, kind):
    """Finding 1: ``HSET replay:meta hi 4000000`` made the next insert evict 4e6 ids."""
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 10)
    r.hset(keys.replay_meta, "hi", "4000000")
    out = bounded(private, lambda c: insert(make(c, keys), 10))
    assert isinstance(out, int)
    still_works(r, keys, make)


@pytest.mark.parametrize("kind", REPLAYS)
@pytest.mark.parametrize("field", ["hi", "lo", "clo", "inserted", "evicted", "batches"])
@pytest.mark.parametrize("value", HOSTILE, ids=[v[:24] for v in HOSTILE])
def test_insert_with_a_hostile_meta_field(private, r, kind, field, value):
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 30, "before")
    r.hset(keys.replay_meta, field, value)
    out = bounded(private, lambda c: insert(make(c, keys), 10, "hostile"))
    assert isinstance(out, int), out
    still_works(r, keys, make)


def _whole_or_text():
    return st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        st.integers(-(10**7), 10**7).map(str),
        st.floats(allow_nan=True).map(repr),
        st.text(max_size=20),
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(sorted(REPLAYS)),
    meta=st.dictionaries(st.sampled_from(["hi", "lo", "clo", "inserted"]), _whole_or_text()),
    ring=st.binary(max_size=64),
    n=st.integers(1, 2 * CAP),
)
def test_any_stored_meta_and_ring_give_a_bounded_insert(private, r, kind, meta, ring, n):
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 50, "before")
    if meta:
        r.hset(keys.replay_meta, mapping=meta)
    if ring:
        r.setrange(keys.replay_index, 0, ring)
    out = bounded(private, lambda c: insert(make(c, keys), n, "hostile"))
    assert isinstance(out, int), out
    still_works(r, keys, make)


WRONG_TYPES: dict[str, Callable[[redis.Redis, str], Any]] = {
    "string": lambda c, k: c.set(k, "x"),
    "list": lambda c, k: c.rpush(k, "x"),
    "hash": lambda c, k: c.hset(k, "x", "1"),
    "zset": lambda c, k: c.zadd(k, {"x": 1}),
}
REPLAY_KEYS = [
    "replay_priorities",
    "replay_data",
    "replay_meta",
    "replay_batches",
    "replay_index",
    "replay_frames",
]


@pytest.mark.parametrize("kind", REPLAYS)
@pytest.mark.parametrize("key", REPLAY_KEYS)
@pytest.mark.parametrize("wrong", WRONG_TYPES)
@pytest.mark.parametrize("mode", ["rank", "proportional"])
def test_replay_keys_of_the_wrong_type(private, r, kind, key, wrong, mode):
    """Every replay script (insert, both samplings) on a key of another type: repaired."""
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 30, "before")
    name = getattr(keys, key)
    r.delete(name)
    WRONG_TYPES[wrong](r, name)
    bounded(private, lambda c: make(c, keys, mode).sample(8))
    out = bounded(private, lambda c: insert(make(c, keys, mode), 10, "hostile"))
    assert isinstance(out, int), out
    bounded(private, lambda c: make(c, keys, mode).sample(8))
    still_works(r, keys, make)


BOGUS_MEMBERS = {
    "bogus": 1e4,
    "-1": float("inf"),
    "1e300": float("-inf"),
    "99999999999999999999": 1e308,
    "4.5": -1e308,
    "": 0.0,
    "x" * 300: 5.0,
}


@pytest.mark.parametrize("kind", REPLAYS)
@pytest.mark.parametrize("mode", ["rank", "proportional"])
def test_sampling_over_hostile_priorities(private, r, kind, mode):
    """Bogus members with extreme scores: each sample is bounded and does not raise; what
    it draws of them is removed."""
    keys, make = fresh_keys(), REPLAYS[kind]
    insert(make(r, keys), 30, "before")
    r.zadd(keys.replay_priorities, BOGUS_MEMBERS)
    for _ in range(20):
        bounded(private, lambda c: make(c, keys, mode).sample(16))
        bounded(private, lambda c: make(c, keys, mode).mass())
    assert r.zcard(keys.replay_priorities) < 30 + len(BOGUS_MEMBERS)
    still_works(r, keys, make)


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
        script = c.register_script(stream_scripts.LEAVE)
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
    configured count, ``_LOOK`` reads a chunk of leases, ``_KEEP`` keeps or releases)."""
    keys = fresh_keys()
    LEASE_STATES[state](r, keys)

    def claim(c: redis.Redis) -> Any:
        lease = ids_module.claim_id(c, keys, "actor", 4)
        lease.release()
        return lease.ident

    def look(c: redis.Redis) -> Any:
        names = [keys.lease("actor", i) for i in range(64)]
        return c.register_script(ids_module._LOOK)(keys=names, args=[10])

    def keep(c: redis.Redis) -> Any:
        key = keys.lease("actor", 0)
        return [
            c.eval(ids_module._KEEP, 1, key, "me", 10, "keep"),
            c.eval(ids_module._KEEP, 1, key, "me", 10, "release"),
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
    """live.py's scripts over whatever the live-config hash holds: a role's poll (``_READ``,
    run by every role's stop-flag check) and ``qrl run set``'s compare-and-set (``_SET``),
    which replaces what it cannot read."""
    keys = fresh_keys()
    create_run(r, keys, "impala", ImpalaConfig())
    LIVE_STATES[state](r, keys)
    bounded(private, lambda c: live._read(live._ReadOnly(c), keys, b""))
    _, cfg = bounded(private, lambda c: live.set_live(c, keys, ImpalaConfig, {"lr": 1e-4}))
    assert cfg.lr == 1e-4


# -- every script has its cases


COVERED = {
    ("replay/store.py", "scripts.INSERT"),
    ("replay/store.py", "scripts.FETCH_RANKS"),
    ("replay/store.py", "scripts.SAMPLE_PROPORTIONAL"),
    ("replay/frames.py", "_INSERT"),
    ("wire/streams.py", "lua.ACK"),
    ("wire/streams.py", "lua.ADD_IF_ROOM"),
    ("wire/streams.py", "lua.ADOPT"),
    ("wire/streams.py", "lua.DEAD_LETTER"),
    ("wire/streams.py", "lua.ENSURE_GROUP"),
    ("wire/streams.py", "lua.LEAVE"),
    ("wire/streams.py", "lua.READ"),
    ("runtime/ids.py", "_KEEP"),
    ("runtime/ids.py", "_LOOK"),
    ("runtime/ids.py", "_TAKE"),
    ("runtime/live.py", "_SET"),
    ("wire/weights.py", "_PUBLISH"),
}
_SCRIPT_CALL = re.compile(r"(?:register_script|\.eval)\(([^)]*(?:\)[^)]*)?)\)")


def test_every_script_is_covered():
    """Each Lua script qrl registers or evals (a module constant holding Lua) has cases
    above; a new one fails here until it gets some. The shared prelude of the replay's
    scripts runs in every one of them."""
    root = Path(__file__).resolve().parents[1] / "qrl"
    found = set()
    for path in root.rglob("*.py"):
        if path.name == "__main__.py":  # runs the CLI when imported
            continue
        module = importlib.import_module(
            ".".join(("qrl", *path.relative_to(root).with_suffix("").parts))
        )
        for call in _SCRIPT_CALL.findall(path.read_text()):
            for name in re.findall(r"\b[\w.]*[A-Z][A-Z_]+\b", call):
                value = functools.reduce(getattr, name.split("."), module)
                if isinstance(value, str) and "redis.call" in value and "PRELUDE" not in name:
                    found.add((path.relative_to(root).as_posix(), name))
    assert found == COVERED


@pytest.mark.parametrize("kind", REPLAYS)
def test_ids_near_the_top_start_again_from_0(private, r, kind):
    """Meta pushed up to the largest id: inserts repair it once and carry on from 0, not
    repair it at every insert."""
    keys, make = fresh_keys(), REPLAYS[kind]
    r.hset(keys.replay_meta, mapping={"hi": str(10**15 - 5), "lo": str(10**15 - 50)})
    for b in range(4):
        bounded(private, lambda c, b=b: insert(make(c, keys), 30, f"b{b}"))
    meta = r.hgetall(keys.replay_meta)
    assert int(meta[b"hi"]) == 90 and int(meta[b"lo"]) <= 60
