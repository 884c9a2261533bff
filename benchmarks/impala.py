"""IMPALA throughput through Redis, each side by side with the same work without Redis.

    python benchmarks/impala.py [--seconds 3] [--rounds 3]

* learner frames/s: the same ``ImpalaLearner`` fed from the trajectory stream (loader thread:
  XREADGROUP, decode, validate, stack; ack after each update) against fed from unroll
  batches already in memory. Goal: ratio >= 0.9.
* actor frames/s: the same ``ImpalaActor`` unroll loop with the stream push (encode + bounded
  XADD) against without it. Goal: ratio >= 0.95.

A frame is one environment step (CartPole-v1). Rounds alternate; medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

from qrl.actors.impala import ImpalaActor
from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.learners.impala import ImpalaLearner
from qrl.learners.unrolls import stack_unrolls
from qrl.runtime.loop import run_role
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.codec import encode
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.streams import FIELD, Entry, ensure_group


def learner_rates(url: str, keys: RunKeys, cfg: ImpalaConfig, seconds: float, rounds: int):
    client = connect(url)
    actor = ImpalaActor(client, keys, cfg, 0)
    actor.version = 0
    obs, _ = actor.envs.reset()
    msgs = []
    for _ in range(8):
        msg, obs = actor.unroll(obs)
        msgs.append(msg)
    payloads = [encode("impala.unrolls", m) for m in msgs]
    lrn = ImpalaLearner(lambda: connect(url), keys, cfg, "cpu")
    per_batch = cfg.batch_unrolls // cfg.envs_per_actor
    pool = [
        stack_unrolls(
            [Entry("0-0", msgs[(i + k) % len(msgs)]) for k in range(per_batch)], lrn.device
        )
        for i in range(8)
    ]
    for b in pool:
        b.entries = []  # nothing to acknowledge on the in-memory side
    frames_per_update = cfg.batch_unrolls * cfg.unroll
    ours, mem = [], []
    for _ in range(rounds):
        # fill the stream with enough entries for this round, then time the learner on it
        n_updates = 0
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            lrn.update(pool[n_updates % len(pool)])
            n_updates += 1
        mem.append(n_updates * frames_per_update / (time.perf_counter() - t))
        pipe = client.pipeline(transaction=False)
        for i in range(n_updates * per_batch + 2 * per_batch):
            pipe.xadd(trajectories(keys), {FIELD: payloads[i % len(payloads)]})
        pipe.execute()
        t = time.perf_counter()
        done = run_role(lrn, client, keys, 0, lambda: False, limit=n_updates, report_every=1e9)
        ours.append(done * frames_per_update / (time.perf_counter() - t))
        client.delete(trajectories(keys))
        ensure_group(client, trajectories(keys))
    return statistics.median(ours), statistics.median(mem)


def actor_rates(url: str, keys: RunKeys, cfg: ImpalaConfig, seconds: float, rounds: int):
    client = connect(url)
    actor = ImpalaActor(client, keys, cfg, 1)
    actor.producer.maxlen = 10**9  # measure the push, not a consumer: the stream is cleared
    actor.version = 0
    obs, _ = actor.envs.reset()
    with_push, without = [], []
    for _ in range(rounds):
        for push, out in ((True, with_push), (False, without)):
            steps0, t = actor.steps, time.perf_counter()
            while time.perf_counter() - t < seconds:
                msg, obs = actor.unroll(obs)
                if push:
                    actor.producer.add(encode("impala.unrolls", msg))
                actor.refresh_weights()
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
        lr, lm = learner_rates(server.url, keys, cfg, args.seconds, args.rounds)
        ar, am = actor_rates(server.url, RunKeys("bench-impala"), cfg, args.seconds, args.rounds)
    print(
        f"CartPole-v1, unroll {cfg.unroll}, {cfg.envs_per_actor} envs/actor, "
        f"batch {cfg.batch_unrolls} unrolls, CPU"
    )
    print(f"{'':<28} {'frames/s':>10}")
    print(f"{'learner fed through Redis':<28} {lr:>10.0f}")
    print(f"{'learner fed from memory':<28} {lm:>10.0f}   ratio {lr / lm:.2f}")
    print(f"{'actor with stream push':<28} {ar:>10.0f}")
    print(f"{'actor without push':<28} {am:>10.0f}   ratio {ar / am:.2f}")


if __name__ == "__main__":
    main()
