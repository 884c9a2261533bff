"""Ape-X learner throughput: fed from the Redis replay vs fed from in-memory batches.

    python benchmarks/learner.py [--updates 2000] [--rounds 3] [--device cpu]
    python benchmarks/learner.py --atari [--updates 100] [--transitions 20000] [--device cuda]

Both sides run the same ``ApexLearner.update`` (double DQN, dueling, Adam, publishing weights
every 10 updates). "redis" takes prioritized batches sampled from a filled Redis replay by the
learner's sampler process, which also writes the priorities back; "memory" cycles through
batches already on the device. Rounds alternate; the ratio is redis / memory
(goal >= 0.9).

``--atari``: ALE/Pong-v5 (84x84x4 uint8 stacks, the Nature CNN), the replay filled by a real
actor and replay filler (benchmarks/atari_bytes.py) in the frame layout
(qrl/replay/frames.py): the sampler process fetches chunks and decompresses frames.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import numpy as np
from atari_bytes import ENV, fill_from_actor

from qrl.algos.apex.config import ApexConfig
from qrl.learners.apex import ApexLearner
from qrl.learners.replay import Batch
from qrl.replay.role import make_replay
from qrl.runtime.loop import run_role
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys


def fill(replay, n: int, rng: np.random.Generator) -> None:
    for start in range(0, n, 1000):
        k = min(1000, n - start)
        obs = rng.standard_normal((k, 4)).astype(np.float32)
        recs = replay.layout.pack(
            obs, rng.integers(0, 2, k), rng.standard_normal(k), np.full(k, 0.97), obs + 0.1
        )
        replay.insert(recs, rng.random(k) + 0.01)


def redis_round(lrn: ApexLearner, updates: int) -> float:
    t = time.perf_counter()
    lrn.stopping.clear()
    run_role(lrn, lrn.client, lrn.keys, 0, lambda: False, limit=updates, report_every=1e9)
    return updates / (time.perf_counter() - t)


def memory_round(lrn: ApexLearner, pool: list[Batch], updates: int) -> float:
    send = lrn.send_priorities
    lrn.send_priorities = lambda b: None  # no Redis on this side: priorities are dropped
    t = time.perf_counter()
    for i in range(updates):
        lrn.update(pool[i % len(pool)])
    rate = updates / (time.perf_counter() - t)
    lrn.send_priorities = send
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=2000, help="updates per round and side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transitions", type=int, default=100_000, help="replay fill")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--mode", default="rank", choices=["rank", "proportional"])
    ap.add_argument("--atari", action="store_true", help="Pong frames and the Nature CNN")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    atari = {"env": ENV, "steps_per_update": 0, "stream_maxlen": 100_000} if args.atari else {}
    cfg = ApexConfig(
        replay_mode=args.mode, learning_starts=1000, batch_size=args.batch_size, **atari
    )
    rng = np.random.default_rng(0)
    with EmbeddedRedis() as server:
        keys = RunKeys("bench-learner")
        client = connect(server.url)
        create_run(client, keys, "apex", cfg)
        replay = make_replay(client, keys, cfg, seed=0)
        if args.atari:
            fill_from_actor(client, keys, cfg, args.transitions)
        else:
            fill(replay, args.transitions, rng)
        lrn = ApexLearner(partial(connect, server.url), keys, cfg, device=args.device)
        pool = [Batch(replay.sample(cfg.batch_size, cfg.beta), lrn.device) for _ in range(64)]
        ours, mem = [], []
        for _ in range(args.rounds):
            ours.append(redis_round(lrn, args.updates))
            mem.append(memory_round(lrn, pool, args.updates))
        r, m = statistics.median(ours), statistics.median(mem)
        print(
            f"{cfg.env} {replay.layout.obs_shape}, device {lrn.device}, batch {cfg.batch_size},"
            f" {args.mode} replay of {replay.size()}"
        )
        print(f"{'fed from':<10} {'updates/s':>10}")
        print(f"{'redis':<10} {r:>10.0f}\n{'memory':<10} {m:>10.0f}\nratio {r / m:.2f}")


if __name__ == "__main__":
    main()
