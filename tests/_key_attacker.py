"""Until killed: key-level attacks on a run, one every EVERY seconds, in turn (issue 28's
findings as a writer with the run's keys would make them). ``python tests/_key_attacker.py
URL RUN ALGO EVERY``; prints the name of each attack as it is made.

Where ``tests/_hostile_writer.py`` writes bad *entries*, this writes bad *keys*: replay
counters that would make a Lua loop run for ever, bogus replay members, a weights version at
the float-safe limit, keys of the wrong type, the consumer group destroyed, oversized and
flooded stream entries, thousands of fake consumers, metrics reports from fake processes
with absurd counters, and lease keys without a TTL. Each attack is redone in turn, so the
roles must repair and go on, not just survive once."""

import sys
import time
import uuid

import numpy as np
import redis

from qrl.algos.es.keys import es_params, es_results
from qrl.algos.impala.keys import trajectories
from qrl.algos.ppo.keys import rollouts
from qrl.ps.protocol import gradients, params
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys

url, run, algo, every = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
r = redis.Redis.from_url(url)
keys = RunKeys(run)
rng = np.random.default_rng(28)
STREAM, WEIGHTS = {
    "apex": (keys.experience, keys.weights),
    "impala": (trajectories(keys), keys.weights),
    "ppo": (rollouts(keys), keys.weights),
    "es": (es_results(keys), es_params(keys)),
    "a3c": (gradients(keys, 0), params(keys)),  # worker 0's stream
}[algo]
LIMIT = 2**53 - 1


def replay_meta() -> None:
    field, value = [("hi", 4e6), ("lo", -1e15), ("hi", 1e15), ("seq", "x"), ("lo", "nan")][
        int(rng.integers(5))
    ]
    r.hset(keys.replay_meta, field, value)


def replay_members() -> None:
    r.zadd(keys.replay_priorities, {f"bogus{rng.integers(1 << 30)}": 1e4})
    member = r.zrandmember(keys.replay_priorities)
    if member is not None:  # a wrong-size record under a real member
        r.hset(keys.replay_data, member, b"short")


def weights_version() -> None:
    r.hset(WEIGHTS, "version", LIMIT)


def wrong_types() -> None:
    for key in (keys.control, keys.stats, keys.metrics("actor", 0), keys.deadletter):
        r.delete(key)
        r.set(key, "x")
    r.delete(keys.lease("actor", 0))
    r.hset(keys.lease("actor", 0), "a", "b")


def destroy_group() -> None:
    r.xgroup_destroy(STREAM, "qrl")


def oversized() -> None:
    for _ in range(3):
        r.xadd(STREAM, {"d": rng.bytes(4 << 20)})


def flood() -> None:
    pipe = r.pipeline(transaction=False)
    for _ in range(2_000):
        pipe.xadd(STREAM, {"d": b"junk"})
    pipe.execute()


def consumers() -> None:
    pipe = r.pipeline(transaction=False)
    for _ in range(5_000):
        pipe.execute_command("XGROUP", "CREATECONSUMER", STREAM, "qrl", uuid.uuid4().hex)
    pipe.execute()


def fake_metrics() -> None:
    pipe = r.pipeline(transaction=False)
    for _ in range(1_000):
        ident = int(rng.integers(1 << 40)) if rng.random() < 0.5 else int(rng.integers(32))
        values = {"steps": 1e15, "updates": 1e15, "episodes": 1e15, "return": 1e9}
        msg = {"time": time.time(), "values": values}
        pipe.xadd(keys.metrics("actor", ident), {"d": encode("metrics", msg)})
    pipe.execute()


def fake_leases() -> None:
    pipe = r.pipeline(transaction=False)
    for i in range(2_000):
        pipe.set(keys.lease("actor", 1_000 + i), "evil:1:x")
    pipe.execute()


ATTACKS = [
    weights_version,
    wrong_types,
    destroy_group,
    oversized,
    flood,
    consumers,
    fake_metrics,
    fake_leases,
] + ([replay_meta, replay_members] if algo == "apex" else [])

made = 0
while True:
    attack = ATTACKS[made % len(ATTACKS)]
    try:
        attack()
    except redis.ResponseError as e:  # no group or a wrong-type key right now: fine
        print(attack.__name__, "refused:", e, flush=True)
    made += 1
    print(attack.__name__, flush=True)
    time.sleep(every)  # the attacks' pace (argv): nothing to wait for, it runs till killed
