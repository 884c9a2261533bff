"""Ape-X learner throughput: fed from the Redis replay vs fed from in-memory batches, where
each update's time goes, and what the data path alone delivers.

    python benchmarks/learner.py [--updates 2000] [--rounds 3] [--samplers 1 2] [--device cpu]
    python benchmarks/learner.py --atari [--updates 100] [--transitions 20000] [--device cuda]
    python benchmarks/learner.py --feed-only [--atari] --batch-size 512 --samplers 1 2 4

Both sides run the same ``ApexLearner`` (double DQN, dueling, Adam, publishing weights every
10 updates). "redis" takes prioritized batches sampled from a filled Redis replay by the
learner's sampler processes (``--samplers``: each count its own rounds), which also write the
priorities back, handed over in the shared-memory ring (qrl/replay/ring.py); "memory" cycles
through batches already on the device. Rounds alternate; each is timed from its first update
on (the samplers' start, a ``spawn`` of ~1 s, is not counted). The ratio is redis / memory
(goal >= 0.95). Per update: ``wait`` for a batch, ``transfer`` (its tensors made on the
device from the ring slot: views on CPU, an asynchronous copy from pinned memory on CUDA,
whose end the compute then waits for) and ``compute`` (the rest: loss, step, publishing).

``--feed-only``: the learner replaced by a consumer that takes each batch and gives its slot
back, so the rate is the data path's alone (transitions/s), for each ``--samplers`` count.

``--atari``: ALE/Pong-v5 (84x84x4 uint8 stacks, the Nature CNN), the replay filled by a real
actor and replay filler (benchmarks/atari_bytes.py) in the frame layout
(qrl/replay/frames.py): the samplers fetch chunks and decompress frames.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
from atari_bytes import ENV, fill_from_actor

from qrl.algos.apex.config import ApexConfig
from qrl.learners.apex import ApexLearner
from qrl.learners.replay import Batch
from qrl.replay.role import make_replay
from qrl.replay.sampler import Sampler
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys

WARMUP = 20  # updates before a round's clock starts


@dataclass
class Round:
    rate: float  # updates/s
    wait: float  # seconds per update
    transfer: float
    compute: float


def fill(replay, n: int, rng: np.random.Generator) -> None:
    for start in range(0, n, 1000):
        k = min(1000, n - start)
        obs = rng.standard_normal((k, 4)).astype(np.float32)
        recs = replay.layout.pack(
            obs, rng.integers(0, 2, k), rng.standard_normal(k), np.full(k, 0.97), obs + 0.1
        )
        replay.insert(recs, rng.random(k) + 0.01)


def redis_round(lrn: ApexLearner, updates: int, samplers: int) -> Round:
    never = lambda: False  # noqa: E731
    if "samplers" in type(lrn.cfg).model_fields:  # (an older tree has one sampler)
        lrn.cfg = lrn.cfg.replace(samplers=samplers)
    lrn.start(never)
    try:
        end = lrn.updates + WARMUP
        while lrn.updates < end:
            lrn.step(never)
        w0, x0, end = lrn.wait_s, getattr(lrn, "transfer_s", 0.0), lrn.updates + updates
        t = time.perf_counter()
        while lrn.updates < end:
            lrn.step(never)
        dt = time.perf_counter() - t
    finally:
        lrn.close(never)
    wait, transfer = lrn.wait_s - w0, getattr(lrn, "transfer_s", 0.0) - x0
    return Round(
        updates / dt, (wait - transfer) / updates, transfer / updates, (dt - wait) / updates
    )


def memory_round(lrn: ApexLearner, pool: list[Batch], updates: int) -> Round:
    if hasattr(lrn, "send_priorities"):  # an older tree sent them to its sampler here
        lrn.send_priorities = lambda b: None
    t = time.perf_counter()
    for i in range(updates):  # the new priorities are made, then dropped (no Redis here)
        lrn.update(pool[i % len(pool)])
    dt = time.perf_counter() - t
    return Round(updates / dt, 0.0, 0.0, dt / updates)


def feed_round(lrn: ApexLearner, samplers: int, seconds: float) -> float:
    """Transitions/s taken from the ring by a consumer that only gives the slots back."""
    sampler = Sampler(lrn.sampler_spec(), samplers, lrn.cfg.prefetch)
    try:
        while (s := sampler.get(30)) is None:
            pass
        sampler.release(s.slot)
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            if (s := sampler.get(1.0)) is not None:
                n += len(s.ids)
                sampler.release(s.slot)
        return n / (time.perf_counter() - t)
    finally:
        sampler.stop()


def med(rounds: list[Round]) -> Round:
    return Round(*(statistics.median(getattr(r, f) for r in rounds) for f in Round.__annotations__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=2000, help="updates per round and side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transitions", type=int, default=100_000, help="replay fill")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--mode", default="rank", choices=["rank", "proportional"])
    ap.add_argument("--atari", action="store_true", help="Pong frames and the Nature CNN")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--samplers", type=int, nargs="+", default=[1], help="sampler processes")
    ap.add_argument("--prefetch", type=int, default=4, help="ring slots")
    ap.add_argument("--feed-only", action="store_true", help="the data path alone")
    ap.add_argument("--seconds", type=float, default=10.0, help="per --feed-only round")
    args = ap.parse_args()
    atari = {"env": ENV, "steps_per_update": 0, "stream_maxlen": 100_000} if args.atari else {}
    cfg = ApexConfig(
        replay_mode=args.mode,
        learning_starts=1000,
        batch_size=args.batch_size,
        **({"prefetch": args.prefetch} if "prefetch" in ApexConfig.model_fields else {}),
        **atari,
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
        print(
            f"{cfg.env} {replay.layout.obs_shape}, device {lrn.device}, batch {cfg.batch_size},"
            f" {args.mode} replay of {replay.size()}, {args.prefetch} ring slots"
        )
        if args.feed_only:
            feeds = {k: [] for k in args.samplers}
            for _ in range(args.rounds):
                for k in args.samplers:
                    feeds[k].append(feed_round(lrn, k, args.seconds))
            print(f"{'samplers':<10} {'transitions/s':>14}  (rounds)")
            for k, f in feeds.items():
                print(f"{k:<10} {statistics.median(f):>14,.0f}  {' '.join(f'{x:,.0f}' for x in f)}")
            return
        pool = [Batch(replay.sample(cfg.batch_size, cfg.beta), lrn.device) for _ in range(64)]
        ours: dict[int, list[Round]] = {k: [] for k in args.samplers}
        mem: list[Round] = []
        for _ in range(args.rounds):
            for k in args.samplers:
                ours[k].append(redis_round(lrn, args.updates, k))
            mem.append(memory_round(lrn, pool, args.updates))
        m = med(mem)
        print(
            f"{'fed from':<20} {'updates/s':>10} {'ratio':>6}   ms per update: "
            "wait transfer compute"
        )
        rows = [(f"redis, {k} sampler{'s' * (k > 1)}", med(r)) for k, r in ours.items()]
        for name, r in [*rows, ("memory", m)]:
            print(
                f"{name:<20} {r.rate:>10.0f} {r.rate / m.rate:>6.2f}"
                f"   {r.wait * 1e3:>17.3f} {r.transfer * 1e3:>8.3f} {r.compute * 1e3:>7.3f}"
            )


if __name__ == "__main__":
    main()
