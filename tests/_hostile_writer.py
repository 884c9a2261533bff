"""Until killed: adds hostile-but-decodable entries to a run's stream and garbage to its
weights key (random bytes, and blobs that decode but do not fit), one of each every EVERY
seconds. ``python tests/_hostile_writer.py URL RUN ALGO EVERY``; prints the stream's key,
then a line per write: its count and the id of the entry it added.

The entries are hostile where a consumer could crash or stall: versions, generations and
ids at 2**53, batch ids of emoji, the largest batches the run admits now and then, every
step truncated, ES returns at +-1e9, episode lengths of 2**31-1, subnormal and zero
priorities. Their observations, rewards and logits are plausible, not extreme: values at the
schema's bounds survive every consumer (``tests/test_hostile.py``), but no bound can stop a
writer from misleading learning with them, and this test is about finishing the job."""

import sys
import time
import uuid

import numpy as np
import redis

from qrl.algos.es.keys import es_params
from qrl.algos.es.keys import es_results as es_results_key
from qrl.algos.impala.keys import trajectories
from qrl.algos.ppo.keys import rollouts
from qrl.ps.protocol import gradients, params
from qrl.rl.fields import RETURN_BOUND
from qrl.wire.chunks import encode_whole
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WEIGHTS as WEIGHTS_SCHEMA

url, run, algo, every = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
r = redis.Redis.from_url(url)
keys = RunKeys(run)
rng = np.random.default_rng(12)
TINY = float(np.finfo(np.float32).smallest_subnormal)
A3C_PARAMS = 4 * 64 + 64 + 64 * 64 + 64 + 64 * 2 + 2 + 64 + 1  # the default net's, one shard


def extreme(shape, bound: float) -> np.ndarray:
    values = np.array([0.0, bound, -bound, TINY, -TINY, 1.0], np.float32)
    return rng.choice(values, size=shape)


def plausible(shape, scale: float = 1.0) -> np.ndarray:
    return (rng.uniform(-scale, scale, size=shape)).astype(np.float32)


def rows(most: int) -> int:
    return most if rng.random() < 0.05 else int(rng.integers(1, 4))


def pick(*options):
    return options[int(rng.integers(len(options)))]


def experience() -> tuple[str, dict]:
    n = rows(280)  # the default run's largest batch: actor_batch + envs x n_step
    return "apex.experience", {
        "obs": plausible((n, 4), 0.2),
        "action": rng.integers(0, 2, n).astype(np.int32),
        "ret": plausible(n),
        "disc": rng.choice(np.array([0.0, 1.0], np.float32), n),
        "next_obs": plausible((n, 4), 0.2),
        "priority": np.abs(extreme(n, 1.0)),
        "version": pick(0, 2**53),
        "actor": 2**53,
        "batch": pick(uuid.uuid4().hex, "\U0001f4a3" * 16),
    }


def unrolls(kind: str = "impala.unrolls", t: int = 20, envs: int = 16) -> tuple[str, dict]:
    b = rows(envs)
    truncated = rng.random((t, b)) < pick(0.0, 1.0)
    k = int(truncated.sum())
    msg = {
        "obs": plausible((t + 1, b, 4), 0.2),
        "action": rng.integers(0, 2, (t, b)).astype(np.int32),
        "reward": np.ones((t, b), np.float32),
        "terminated": np.zeros((t, b), bool),
        "truncated": truncated,
        "logits": plausible((t, b, 2)),
        "trunc_obs": plausible((k, 4), 0.2),
        "trunc_idx": np.argwhere(truncated).astype(np.int32).reshape(-1, 2),
        "version": pick(0, 2**53),
        "actor": 2**53,
        "batch": uuid.uuid4().hex,
    }
    if kind == "ppo.rollouts":
        msg["value"] = plausible((t, b))
    return kind, msg


def es_results() -> tuple[str, dict]:
    n = 1
    generation = int(r.hget(es_params(keys), "version") or 0)  # the current one: it is used
    return "es.results", {
        "generation": pick(generation, 2**53),
        "job": np.full(n, pick(0, 2**53)),
        "index": rng.integers(0, 5_000_000 - 10_000, n),
        "return_pos": extreme(n, RETURN_BOUND),
        "return_neg": extreme(n, RETURN_BOUND),
        "length_pos": np.full(n, pick(1, 2**31 - 1), np.int32),
        "length_neg": np.ones(n, np.int32),
        # statistics an honest worker could have sent: extreme ones would only mislead the
        # observation normalization (poisoning learning, which no schema can tell apart)
        "obs_sum": np.zeros(4),
        "obs_sumsq": np.full(4, float(n)),
        "obs_count": float(n),
        "worker": 2**53,
        "batch": uuid.uuid4().hex,
    }


def gradient() -> tuple[str, dict]:
    """A gradient for the run's one parameter-server shard: stale, current or from the
    future, small or far longer than any clipped gradient (the server drops those)."""
    version = int(r.hget(params(keys), "version") or 0)
    return "ps.gradient", {
        "shard": 0,
        "version": pick(0, version, 2**53),
        "loss": pick(0.0, 1e15, -1e15),
        "grad": pick(plausible(A3C_PARAMS, 1e-4), extreme(A3C_PARAMS, 1e30)),
    }


STREAM, MESSAGE, WEIGHTS = {
    "apex": (keys.experience, experience, keys.weights),
    "impala": (trajectories(keys), unrolls, keys.weights),
    "ppo": (rollouts(keys), lambda: unrolls("ppo.rollouts", 32, 8), keys.weights),
    "es": (es_results_key(keys), es_results, es_params(keys)),
    "a3c": (gradients(keys, 0), gradient, params(keys)),  # worker 0's stream
}[algo]

print(STREAM, flush=True)
sent = 0
while True:
    kind, msg = MESSAGE()
    entry = r.xadd(STREAM, {"d": encode(kind, msg)}).decode()
    # garbage in the weights key, under the version it holds (readers that fetch now see it)
    version = int(r.hget(WEIGHTS, "version") or 0)
    bad = encode_whole(WEIGHTS_SCHEMA, {"params": {"x": np.ones(3)}, "meta": None}, version)
    r.hset(WEIGHTS, "blob", pick(rng.bytes(64), bad))
    sent += 1
    print(sent, entry, flush=True)
    time.sleep(every)  # the attacks' pace (argv): nothing to wait for, it runs till killed
