"""Learner throughput: fed through Redis vs fed from in-memory batches, where each update's
time goes, and what the data path alone delivers.

    python benchmarks/learner.py [--updates 2000] [--rounds 3] [--samplers 1 2] [--device cpu]
    python benchmarks/learner.py --atari [--updates 100] [--transitions 20000] [--device cuda]
    python benchmarks/learner.py --feed-only [--atari] --batch-size 512 --samplers 1 2 4
    python benchmarks/learner.py --atari --device cuda --samplers 12 [--cluster 3] [--pin]
    python benchmarks/learner.py --algo r2d2 [--updates 300]
    python benchmarks/learner.py --algo impala [--updates 1000] [--feed-only]

Both sides run the same learner with its defaults, as its builder makes it: Ape-X's
(``DQNRule``: double DQN, dueling, Adam, publishing weights every 10 updates; CartPole-v1),
R2D2's (``R2D2Rule``: the LSTM Q-network on qrl/CartPoleNoVel-v1) or IMPALA's
(``ImpalaRule``: V-trace; CartPole-v1, ``passes=1`` so that every update takes a new
batch). "redis": the replay learners take prioritized batches sampled from a filled Redis
replay by their sampler processes (``--samplers``: each count its own rounds), which also
write the priorities back; IMPALA's loader process reads the trajectory stream (filled
before each round with a real actor's unrolls), decodes and stacks them, and acknowledges
them after the update. Either hands batches over in a shared-memory ring
(qrl/replay/ring.py). "memory" cycles through batches already on the device. Rounds
alternate within one start of the learner (the data processes' start, a ``spawn`` of ~1 s,
is not counted); the ratio is the median over the pairs of redis / memory
(goal >= 0.95). Per
update: ``wait`` for a batch, ``transfer`` (its tensors made on the device from the ring
slot: views on CPU, an asynchronous copy from pinned memory on CUDA, whose end the compute
then waits for) and ``compute`` (the rest: loss, step, publishing). On CUDA each side's
GPU utilisation is printed too (NVML's, as nvidia-smi shows it, sampled every 0.1 s).

``--feed-only``: the learner replaced by a consumer that takes each batch and gives its slot
back, so the rate is the data path's alone (transitions/s), for each ``--samplers`` count
(IMPALA: its one loader process).

``--atari``: ALE/Pong-v5 (84x84x4 uint8 stacks, the Nature CNN), the replay filled by a real
actor and replay filler (benchmarks/atari_bytes.py) in the frame layout
(qrl/replay/frames.py): the samplers fetch chunks and decompress frames.

``--cluster N`` (Ape-X): the replay in N shards on a local N-node Redis Cluster, so that no
one ``redis-server`` serves every sampler (the Redis column sums the nodes). ``--pin``
(Linux): the learner keeps one CPU and its SMT siblings to itself, the data processes and
Redis servers get the rest (``os.sched_setaffinity``, once the data processes run).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
from dataclasses import dataclass
from functools import cache, partial

import numpy as np
import torch
from atari_bytes import ENV, actor_of, fill_from_actor
from redis.cluster import RedisCluster

from qrl.algos import ALGOS
from qrl.algos.apex.config import ApexConfig
from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.algos.r2d2.config import R2D2Config
from qrl.learners.unrolls import stack_unrolls
from qrl.replay.role import make_replay
from qrl.replay.sampler import Sampler
from qrl.replay.sequences import SequenceFiller, sequence_spec
from qrl.rl.envspec import EnvSpec
from qrl.runtime.algorithm import RoleContext
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.server.embedded_cluster import EmbeddedCluster
from qrl.wire.codec import encode
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.streams import FIELD, Entry, ensure_group

WARMUP = 20  # updates before a round's clock starts


@dataclass
class Round:
    rate: float  # updates/s
    wait: float  # seconds per update
    transfer: float
    compute: float


class GpuUse:
    """The GPU's utilisation as nvidia-smi reads it (NVML: the share of time a kernel ran),
    sampled every 0.1 s by a thread and kept per side of the pairs (``side``: "redis",
    "memory" or None between rounds). Nothing on CPU."""

    def __init__(self, device) -> None:
        self.side: str | None = None
        self.samples: dict[str, list[int]] = {}
        if device.type == "cuda":
            threading.Thread(target=self._poll, args=(device,), daemon=True).start()

    def _poll(self, device) -> None:
        while True:
            if (side := self.side) is not None:
                self.samples.setdefault(side, []).append(torch.cuda.utilization(device))
            time.sleep(0.1)

    def report(self) -> str:
        means = {k: f"{statistics.fmean(v):.0f}%" for k, v in self.samples.items() if v}
        self.samples = {}
        return ", ".join(f"{k} {v}" for k, v in means.items())


def fill(replay, n: int, rng: np.random.Generator) -> None:
    for start in range(0, n, 1000):
        k = min(1000, n - start)
        obs = rng.standard_normal((k, 4)).astype(np.float32)
        recs = replay.layout.pack(
            obs, rng.integers(0, 2, k), rng.standard_normal(k), np.full(k, 0.97), obs + 0.1
        )
        replay.insert(recs, rng.random(k) + 0.01)


class Unrolls:
    """IMPALA's trajectory stream: a real actor's unrolls, encoded once, added before a round
    (no actor runs beside the learner)."""

    def __init__(self, client, keys: RunKeys, cfg: ImpalaConfig) -> None:
        self.client, self.stream = client, trajectories(keys)
        actor = actor_of("impala", client, keys, cfg)
        actor.weights.version = 0
        actor.runner.reset()
        self.msgs = []
        for _ in range(8):
            actor.unit(lambda: False)
            self.msgs.append(actor.sink.unroll)
        self.payloads = [encode("impala.unrolls", m) for m in self.msgs]
        self.per_batch = -(-cfg.batch_unrolls // cfg.envs_per_actor)

    def stock(self, updates: int) -> None:
        """Empty the stream, then add entries for ``updates`` updates (and a few more)."""
        self.client.delete(self.stream)
        ensure_group(self.client, self.stream)
        pipe = self.client.pipeline(transaction=False)
        for i in range((updates + 8) * self.per_batch):
            pipe.xadd(self.stream, {FIELD: self.payloads[i % len(self.payloads)]})
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()

    def pool(self, device) -> list:
        k, n = self.per_batch, len(self.msgs)
        return [
            stack_unrolls([Entry("0-0", self.msgs[(i + j) % n]) for j in range(k)], device)
            for i in range(8)
        ]


def rounds(
    lrn, pool: list, updates: int, samplers: int, blocks: int, gpu: GpuUse, stock=None, pinned=None
):
    """``blocks`` pairs of rounds in one start of the learner: ``updates`` updates fed
    through Redis, then as many fed from ``pool`` (while the data processes wait on a full
    ring), alternating, so both sides of a pair share the machine's speed of the moment
    (it drifts by 20% and more between rounds of a few seconds here). Each Redis round is
    timed from its ``slots + 1``-th update on: the batches loaded during the memory round
    before it are not counted as free."""
    never = lambda: False  # noqa: E731
    if hasattr(lrn.source, "samplers"):  # (IMPALA's: one loader)
        lrn.source.samplers = samplers
    ahead = getattr(lrn.cfg, "prefetch", 4) + 1
    if stock is not None:
        stock(WARMUP + blocks * (updates + ahead))
    ours, mem = [], []

    def steps(n: int) -> None:
        end = lrn.updates + n
        while lrn.updates < end:
            lrn.step(never)

    lrn.start(never)
    try:
        if pinned is not None:
            pin(lrn, pinned)
        steps(WARMUP)
        for _ in range(blocks):
            steps(ahead)
            w0, x0 = lrn.wait_s, lrn.source.transfer_s
            t, gpu.side = time.perf_counter(), "redis"
            steps(updates)
            dt, gpu.side = time.perf_counter() - t, None
            wait, transfer = lrn.wait_s - w0, lrn.source.transfer_s - x0
            ours.append(
                Round(
                    updates / dt,
                    (wait - transfer) / updates,
                    transfer / updates,
                    (dt - wait) / updates,
                )
            )
            t, gpu.side = time.perf_counter(), "memory"
            for i in range(updates):  # the new priorities are made, then dropped (no slot)
                lrn.train(pool[i % len(pool)])
            if lrn.device.type == "cuda":
                torch.cuda.synchronize(lrn.device)
            dt, gpu.side = time.perf_counter() - t, None
            mem.append(Round(updates / dt, 0.0, 0.0, dt / updates))
    finally:
        lrn.close(never)
    return ours, mem


def redis_cpu(client) -> float:
    """CPU seconds the Redis servers have used (user and system; a cluster's nodes summed)."""
    if isinstance(client, RedisCluster):
        nodes = client.info("cpu", target_nodes=RedisCluster.PRIMARIES).values()
    else:
        nodes = [client.info("cpu")]
    return sum(float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in nodes)


@cache
def _cpus() -> list[int]:  # the CPUs this process could use before pin() narrowed them
    return sorted(os.sched_getaffinity(0))


def pin(lrn, servers: list) -> None:
    """The learner on the last CPU this process may use, alone with that CPU's SMT
    siblings (which nothing else is given); its data processes and ``servers`` (their
    ``proc``) on the other CPUs."""
    cpus = _cpus()
    mine = cpus[-1]
    with open(f"/sys/devices/system/cpu/cpu{mine}/topology/thread_siblings_list") as f:
        siblings = set()
        for part in f.read().strip().split(","):
            lo, _, hi = part.partition("-")
            siblings |= set(range(int(lo), int(hi or lo) + 1))
    rest = set(cpus) - siblings - {mine}
    if not rest:
        raise SystemExit("--pin: no CPU is left for the data processes")
    for pid in [*lrn.source.feed.pids, *(s.proc.pid for s in servers)]:
        if pid is not None:
            os.sched_setaffinity(pid, rest)
    os.sched_setaffinity(0, {mine})
    print(
        f"pinned: learner on CPU {mine} (siblings {sorted(siblings - {mine})} idle), "
        f"the rest on {len(rest)} CPUs"
    )


def feed_round(
    lrn, client, samplers: int, seconds: float, unrolls: Unrolls | None = None
) -> tuple[float, float]:
    """Transitions/s (IMPALA: env steps) taken from the ring by a consumer that only gives
    the slots back, and the Redis server's CPU microseconds per transition meanwhile (with
    one server, the rate many samplers can reach is at most a million over it)."""
    if unrolls is not None:  # what the loader can read in ``seconds`` at 200k steps/s
        unrolls.stock(int(seconds * 200_000) // (lrn.cfg.batch_unrolls * lrn.cfg.unroll))
        source = lrn.source.source.open()  # the loader of IMPALA's Passes
        take = lambda timeout: source.get(timeout)  # noqa: E731
        size = lambda s: s.cols["action"].size  # noqa: E731
        give = source.used
    else:
        source = Sampler(lrn.source.spec, samplers, lrn.cfg.prefetch)
        take, size, give = source.get, lambda s: len(s.ids), source.release
    try:
        while (s := take(30)) is None:
            pass
        give(s.slot)
        n, t, cpu = 0, time.perf_counter(), redis_cpu(client)
        while time.perf_counter() - t < seconds:
            if (s := take(1.0)) is None:
                break  # (IMPALA) the stream is read to its end
            n += size(s)
            give(s.slot)
        return n / (time.perf_counter() - t), (redis_cpu(client) - cpu) * 1e6 / max(n, 1)
    finally:
        source.stop()


def med(rounds: list[Round]) -> Round:
    return Round(*(statistics.median(getattr(r, f) for r in rounds) for f in Round.__annotations__))


def learner(algo: str, client, keys: RunKeys, cfg, url: str, device: str):
    """``algo``'s learner as its builder makes it."""
    role = next(r for r in ALGOS[algo].roles if r.name == "learner")
    return role.make(RoleContext(client, partial(connect, url), keys, cfg, 0, device))


def setup(args, client, keys: RunKeys, url: str):
    """The run, its data (a filled replay, or unrolls to stock the stream with), the learner,
    and batches in memory."""
    rng = np.random.default_rng(0)
    if args.algo == "impala":
        cfg = ImpalaConfig(passes=1)
        create_run(client, keys, "impala", cfg)
        lrn = learner("impala", client, keys, cfg, url, args.device)
        unrolls = Unrolls(client, keys, cfg)
        return (
            lrn,
            unrolls.pool(lrn.device),
            unrolls,
            f"{cfg.batch_unrolls} unrolls of {cfg.unroll}",
        )
    # (an older tree, run by compare, may have no such field)
    given = args.prefetch is not None and "prefetch" in ApexConfig.model_fields
    prefetch = {"prefetch": args.prefetch} if given else {}
    if args.algo == "r2d2":
        cfg = R2D2Config(steps_per_update=0, **prefetch)
        create_run(client, keys, "r2d2", cfg)
        fill_from_actor(client, keys, cfg, args.transitions, "r2d2", SequenceFiller)
        layout = sequence_spec(cfg, EnvSpec.of(cfg.env))[0]
        replay = make_replay(client, keys, cfg, seed=0, layout=layout)
        lrn = learner("r2d2", client, keys, cfg, url, args.device)
    else:
        atari = {"env": ENV, "steps_per_update": 0, "stream_maxlen": 100_000} if args.atari else {}
        shards = {"replay_shards": args.cluster} if args.cluster else {}
        cfg = ApexConfig(
            replay_mode=args.mode,
            learning_starts=1000,
            batch_size=args.batch_size,
            **prefetch,
            **atari,
            **shards,
        )
        create_run(client, keys, "apex", cfg)
        if args.atari:
            fill_from_actor(client, keys, cfg, args.transitions)
        else:
            for shard in range(cfg.replay_shards):
                part = make_replay(client, keys, cfg, seed=0, shard=shard)
                fill(part, args.transitions // cfg.replay_shards, rng)
        lrn = learner("apex", client, keys, cfg, url, args.device)
        replay = lrn.source.spec.replay(seed=0)  # every shard, as the samplers draw
    pool = [lrn.source.make(replay.sample(cfg.batch_size, cfg.beta), lrn.device) for _ in range(64)]
    return lrn, pool, None, f"batch {cfg.batch_size}, replay of {replay.size()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", default="apex", choices=["apex", "r2d2", "impala"])
    ap.add_argument("--updates", type=int, default=2000, help="updates per round and side")
    ap.add_argument("--rounds", type=int, default=5, help="pairs of rounds")
    ap.add_argument(
        "--transitions", type=int, default=100_000, help="replay fill (R2D2: sequences)"
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--mode", default="rank", choices=["rank", "proportional"])
    ap.add_argument("--atari", action="store_true", help="Pong frames and the Nature CNN")
    ap.add_argument("--batch-size", type=int, default=64, help="Ape-X's")
    ap.add_argument("--samplers", type=int, nargs="+", default=[1], help="sampler processes")
    ap.add_argument(
        "--prefetch",
        type=int,
        default=None,
        help="ring slots (replay learners; default: the config's)",
    )
    ap.add_argument("--feed-only", action="store_true", help="the data path alone")
    ap.add_argument("--seconds", type=float, default=10.0, help="per --feed-only round")
    ap.add_argument(
        "--io-threads",
        type=int,
        default=1,
        help="the Redis server's io-threads (replies written by that many threads)",
    )
    ap.add_argument("--cluster", type=int, default=0, help="(Ape-X) N shards on N nodes")
    ap.add_argument("--pin", action="store_true", help="the learner alone on one CPU")
    args = ap.parse_args()
    if args.cluster and args.algo != "apex":
        ap.error("--cluster shards Ape-X's replay only")
    if args.algo == "impala":
        args.samplers = [1]  # its one loader process
    if args.transitions is None:
        args.transitions = 5_000 if args.algo == "r2d2" else 100_000
    with contextlib.ExitStack() as stack:
        if args.cluster:
            server = stack.enter_context(EmbeddedCluster(args.cluster))
            servers = server.nodes
        else:
            server = stack.enter_context(EmbeddedRedis(args=("--io-threads", str(args.io_threads))))
            servers = [server]
        keys = RunKeys(f"bench-learner-{args.algo}")
        client = connect(server.url)
        lrn, pool, unrolls, what = setup(args, client, keys, server.url)
        stock = unrolls.stock if unrolls is not None else None
        shape = EnvSpec.of(lrn.cfg.env).obs_shape
        print(f"{args.algo}: {lrn.cfg.env} {shape}, device {lrn.device}, {what}")
        if args.feed_only:
            feeds = {k: [] for k in args.samplers}
            for _ in range(args.rounds):
                for k in args.samplers:
                    feeds[k].append(feed_round(lrn, client, k, args.seconds, unrolls))
            print(f"{'samplers':<10} {'transitions/s':>14} {'Redis us/tr':>12}  (rounds)")
            for k, f in feeds.items():
                rate, cpu = (statistics.median(x[i] for x in f) for i in (0, 1))
                each = " ".join(f"{x:,.0f}" for x, _ in f)
                print(f"{k:<10} {rate:>14,.0f} {cpu:>12.1f}  {each}")
            return
        print(
            f"{'fed from':<20} {'updates/s':>10} {'ratio':>6}   ms per update: "
            "wait transfer compute   (ratio of each pair)"
        )
        data = "loader" if args.algo == "impala" else "sampler"
        gpu = GpuUse(lrn.device)
        pinned = servers if args.pin else None
        for k in args.samplers:
            ours, mem = rounds(lrn, pool, args.updates, k, args.rounds, gpu, stock, pinned)
            pairs = [o.rate / m.rate for o, m in zip(ours, mem, strict=True)]
            ratio = statistics.median(pairs)
            for name, r, x in (
                (f"redis, {k} {data}{'s' * (k > 1)}", med(ours), ratio),
                ("memory", med(mem), 1.0),
            ):
                print(
                    f"{name:<20} {r.rate:>10.0f} {x:>6.2f}   {r.wait * 1e3:>17.3f}"
                    f" {r.transfer * 1e3:>8.3f} {r.compute * 1e3:>7.3f}"
                    + (f"   ({' '.join(f'{p:.2f}' for p in pairs)})" if x != 1.0 else "")
                )
            if use := gpu.report():
                print(f"{'':<20} GPU busy: {use}")


if __name__ == "__main__":
    main()
