"""IMPALA's actor throughput through Redis, side by side with the same work without Redis.

    python benchmarks/impala.py [--seconds 3] [--rounds 3]

Actor frames/s: the same IMPALA actor's unroll loop (``Actor.unit``) with the stream push
(encode + bounded XADD) against without it. Goal: ratio >= 0.95. A frame is one environment step
(CartPole-v1). Rounds alternate; medians are printed.

The learner's side (fed through the stream vs from memory) is ``benchmarks/learner.py
--algo impala``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from atari_bytes import actor_of

from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.codec import encode
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys


def actor_rates(url: str, keys: RunKeys, cfg: ImpalaConfig, seconds: float, rounds: int):
    client = connect(url)
    actor = actor_of("impala", client, keys, cfg, 1)
    actor.sink.producer.maxlen = 10**9  # measure the push, not a consumer: the stream is cleared
    actor.weights.version = 0
    actor.runner.reset()
    with_push, without = [], []
    for _ in range(rounds):
        for push, out in ((True, with_push), (False, without)):
            steps0, t = actor.steps, time.perf_counter()
            while time.perf_counter() - t < seconds:
                actor.unit(lambda: False)
                msg = actor.sink.unroll
                if push:
                    actor.sink.producer.add(encode("impala.unrolls", msg))
                actor.weights.refresh()
            out.append((actor.steps - steps0) / (time.perf_counter() - t))
            client.delete(trajectories(keys))
    return statistics.median(with_push), statistics.median(without)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per round and side")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = ImpalaConfig()
    with EmbeddedRedis() as server:
        client = connect(server.url)
        keys = RunKeys("bench-impala")
        create_run(client, keys, "impala", cfg)
        ar, am = actor_rates(server.url, RunKeys("bench-impala"), cfg, args.seconds, args.rounds)
    print(
        f"CartPole-v1, unroll {cfg.unroll}, {cfg.envs_per_actor} envs/actor, "
        f"batch {cfg.batch_unrolls} unrolls, CPU"
    )
    print(f"{'':<28} {'frames/s':>10}")
    print(f"{'actor with stream push':<28} {ar:>10.0f}")
    print(f"{'actor without push':<28} {am:>10.0f}   ratio {ar / am:.2f}")


if __name__ == "__main__":
    main()
