"""Sharded replay throughput: qrl's replay with 1, 2 and 3 shards (``replay_shards``), on one
Redis node and on a local 3-node Redis Cluster, each beside a plain pipelined redis-py loop
doing the same Redis work on keys of the same hash tags (so the same nodes).

    python benchmarks/shards.py [--shards 1 2 3] [--where node cluster]
                                [--sizes cartpole atari] [--capacity 100000] [--batch 256]
                                [--rounds 3] [--seconds 1] [--pong 8192]

Two sizes (``--sizes``): CartPole, obs (4,) float32, a 44-byte record; Atari, real Pong
transitions (84x84 grayscale, stack 4, n-step 3) as the frame replay stores them: a real
Ape-X actor and filler play ``--pong`` transitions first (``benchmarks/atari_bytes.py``),
whose stored chunks (about 8 per batch of 256) are then inserted again and again.

Every shard is first filled to its capacity (``--capacity`` / S), untimed (qrl's first: the
``used_memory`` it adds, summed over a cluster's masters, over the transitions held, is the
"B/tr in Redis" column); then, in alternating rounds (median of ``--rounds``),
transitions/s, and MB/s of what a transition moves (its record; for Atari its share of the
stored chunks), for:

* insert, qrl: producer batches of ``--batch`` go to the shards in turn, as the fillers
  insert them: the shard's ``insert`` (one Lua script: ZADD + HSET, for Atari the chunks
  and the index ring, and at capacity the FIFO eviction of as many);
* insert, plain: the same batches to the same shards, one pipeline each of the same
  commands (ZADD + HSET [+ SETRANGE of the ring] + ZREM + HDEL of the oldest), no Lua; the
  Atari chunks are encoded beforehand, so the plain side does no LZ4;
* sample, qrl: ``ShardedReplay.sample`` in rank mode, a batch of ``--batch`` across all
  shards (each shard's share in proportion to its size, one Lua call per shard: ZRANGE per
  rank + the records or chunks), record decoding (Atari: the stacks rebuilt) and IS weights;
* sample, plain: per shard, pipelines of ZRANGE <r> <r> REV (WITHSCORES) for its share of
  the batch, then one HMGET (Atari: GETRANGE of the ring, then HGET of each chunk), no
  decoding; the ranks are drawn beforehand, untimed.
* prio, qrl: ``ShardedReplay.update_priorities`` of one sampled batch (the sampler's priority
  write-back: every shard's ZADD XX); plain: the same ZADDs in one redis-py pipeline (the MB/s
  column counts a transition's record, which a write-back does not move).

On a cluster both sides use a cluster client (qrl's ``connect``, redis-py's ``RedisCluster``
for the plain side); the client, in this one process, does all of it. On 2 cores the client is
the bound: the Redis servers share the same cores (docs/benchmarks.md, "Sharded replay and
Redis Cluster"; the profile: notes/benchmarks-notebook.md, "Sharded replay, one node and a
Redis Cluster").
"""

from __future__ import annotations

import argparse
import collections
import statistics
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import redis
from atari_bytes import ENV, fill_from_actor  # benchmarks/atari_bytes.py, beside this file
from redis.cluster import RedisCluster
from replay import Plain, timed, transitions  # benchmarks/replay.py

from qrl.algos.apex.config import ApexConfig
from qrl.replay.frames import FrameBatch, FrameLayout
from qrl.replay.role import make_replay
from qrl.replay.shards import ShardedReplay, shard_capacity
from qrl.replay.store import RecordLayout
from qrl.runtime.runs import create_run, delete_run
from qrl.server.embedded import EmbeddedRedis
from qrl.server.embedded_cluster import EmbeddedCluster
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys


@dataclass
class Workload:
    """Producer batches of one transition size: ``(qrl's batch, the plain side's, priorities)``
    each, and the bytes a transition moves (its record, or its share of the stored chunks)."""

    name: str
    layout: RecordLayout
    batches: list
    bytes_per: float

    def plain(self, client: redis.Redis, capacity: int, prefix: str) -> Plain:
        if isinstance(self.layout, FrameLayout):
            return PlainFrames(client, capacity, prefix)
        return Plain(client, capacity, prefix + "plain:prio", prefix + "plain:data")

    def plain_insert(self, plain: Plain, i: int) -> int:
        _, theirs, prio = self.batches[i % len(self.batches)]
        if isinstance(plain, PlainFrames):
            plain.insert_chunks(theirs, prio)
        else:
            plain.insert(theirs, prio, evict=True)
        return len(prio)


def cartpole(batch: int) -> Workload:
    layout = RecordLayout((4,), "float32")
    pool = transitions(layout, 64, batch, np.random.default_rng(0))
    return Workload("cartpole", layout, [(r, r, p) for r, p in pool], layout.size)


def atari(url: str, batch: int, transitions: int) -> Workload:
    layout, batches = pong_batches(url, transitions, batch)
    rng = np.random.default_rng(0)
    out = [(fb, chunks, rng.gamma(1.0, 1.0, len(fb)) + 1e-3) for fb, chunks in batches]
    stored = sum(len(blob) for _, chunks, _ in out for blob, _ in chunks)
    return Workload("atari", layout, out, stored / sum(len(p) for *_, p in out))


def measure(
    url: str, cluster: bool, shards: int, work: Workload, args: argparse.Namespace
) -> dict[str, float]:
    """Median transitions/s of each side and operation for one setting."""
    rng = np.random.default_rng(0)
    keys = RunKeys(f"bench-{work.name}-s{shards}")
    cap = shard_capacity(args.capacity, shards)
    qclient = connect(url)
    pclient = RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    replay = ShardedReplay(
        qclient, keys, work.layout, args.capacity, shards=shards, alpha=args.alpha, seed=1
    )
    plains = [work.plain(pclient, cap, k.prefix) for k in keys.shards(shards)]
    # fill every shard to capacity, untimed; qrl's first, to read its memory
    before = used_memory(pclient)
    for s in range(shards):
        i = 0
        while replay.parts[s].size() < cap:
            qb, _, prio = work.batches[i % len(work.batches)]
            replay.parts[s].insert(qb, prio)
            i += 1
    bytes_per = (used_memory(pclient) - before) / (shards * cap)
    for s in range(shards):
        i = 0
        while plains[s].hi - plains[s].lo < cap:
            work.plain_insert(plains[s], i)
            i += 1
    cdf = np.cumsum(np.arange(1, cap + 1, dtype=np.float64) ** -args.alpha)
    share = [args.batch // shards + (s < args.batch % shards) for s in range(shards)]
    rank_pool = []
    for _ in range(64):
        per_shard = []
        for s in range(shards):
            u = (np.arange(share[s]) + rng.random(share[s])) / share[s]
            per_shard.append(np.searchsorted(cdf, u * cdf[-1], side="right").tolist())
        rank_pool.append(per_shard)
    replay.sample(args.batch, args.beta)  # builds the CDFs once, outside the timing

    def q_insert(i: int) -> int:
        qb, _, prio = work.batches[i % len(work.batches)]
        replay.parts[i % shards].insert(qb, prio)
        return len(prio)

    def p_insert(i: int) -> int:
        return work.plain_insert(plains[i % shards], i)

    def q_sample(i: int) -> int:
        return len(replay.sample(args.batch, args.beta).ids)

    def p_sample(i: int) -> int:
        return sum(len(p.sample(r)) for p, r in zip(plains, rank_pool[i % 64], strict=True))

    drawn = replay.sample(args.batch, args.beta)
    new_prio = rng.random(len(drawn.ids)) + 0.5
    if shards == 1:  # one shard's ids are the replay's own, without a shard number
        updates = [(replay.parts[0].keys.replay_priorities, drawn.ids, new_prio)]
    else:
        updates = [
            (replay.parts[s].keys.replay_priorities, own, new_prio[at])
            for s, (at, own) in replay._by_shard(drawn.ids).items()
        ]

    def q_prio(i: int) -> int:
        replay.update_priorities(drawn.ids, new_prio)
        return len(drawn.ids)

    def p_prio(i: int) -> int:
        pipe = pclient.pipeline(transaction=False)
        for key, local, prio in updates:
            pipe.zadd(key, dict(zip(local, prio.tolist(), strict=True)), xx=True)
        pipe.execute()
        return len(drawn.ids)

    sides = {
        "q_ins": q_insert,
        "p_ins": p_insert,
        "q_smp": q_sample,
        "p_smp": p_sample,
        "q_pri": q_prio,
        "p_pri": p_prio,
    }
    rates: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            rates[name].append(timed(fn, args.seconds))
    assert replay.size() >= shards * (cap - 1), (replay.size(), shards * cap)
    for k in keys.shards(shards):  # leave the Redis as found
        delete_run(qclient, k)
    qclient.close()
    pclient.close()
    return {"bytes": bytes_per, **{k: statistics.median(v) for k, v in rates.items()}}


class PlainFrames(Plain):
    """The frame replay's Redis work, pipelined, no Lua: ZADD of the priorities, HSET of each
    chunk (encoded beforehand, untimed: the plain side does no LZ4) under its first id, the
    index ring (SETRANGE), and at capacity ZREM of the oldest ids and HDEL of the chunks left
    without transitions; sampling: ZRANGE per rank, GETRANGE of the ring, HGET of the chunk."""

    def __init__(self, client: redis.Redis, capacity: int, prefix: str) -> None:
        super().__init__(client, capacity, prefix + "plain:prio", prefix + "plain:frames")
        self.ring = prefix + "plain:index"
        self.starts: collections.deque[int] = collections.deque()  # chunk starts, oldest first

    def insert_chunks(self, chunks: list[tuple[bytes, int]], priorities: np.ndarray) -> None:
        n = len(priorities)
        first, self.hi = self.hi, self.hi + n
        z: list[object] = [None] * (2 * n)
        z[0::2] = map(repr, priorities.tolist())
        z[1::2] = range(first, self.hi)
        h: list[object] = []
        ring = np.empty(n, "<u4")
        at = 0
        for blob, m in chunks:
            h += [first + at, blob]
            self.starts.append(first + at)
            ring[at : at + m] = np.arange(m)
            at += m
        pipe = self.client.pipeline(transaction=False)
        pipe.execute_command("ZADD", self.prio, *z)
        pipe.execute_command("HSET", self.data, *h)
        slot = first % self.capacity
        head = min(n, self.capacity - slot)
        pipe.execute_command("SETRANGE", self.ring, slot * 4, ring[:head].tobytes())
        if head < n:
            pipe.execute_command("SETRANGE", self.ring, 0, ring[head:].tobytes())
        if self.hi - self.lo > self.capacity:
            new_lo = self.hi - self.capacity
            pipe.execute_command("ZREM", self.prio, *range(self.lo, new_lo))
            gone = []
            while len(self.starts) > 1 and self.starts[1] <= new_lo:
                gone.append(self.starts.popleft())
            if gone:
                pipe.execute_command("HDEL", self.data, *gone)
            self.lo = new_lo
        pipe.execute()

    def sample(self, ranks: list[int]) -> list[bytes]:
        pipe = self.client.pipeline(transaction=False)
        for r in ranks:
            pipe.execute_command("ZRANGE", self.prio, r, r, "REV")
        ids = [int(m[0]) for m in pipe.execute() if m]
        for i in ids:
            at = (i % self.capacity) * 4
            pipe.execute_command("GETRANGE", self.ring, at, at + 3)
        rel = pipe.execute()
        for i, d in zip(ids, rel, strict=True):
            pipe.execute_command("HGET", self.data, i - int.from_bytes(d, "little"))
        return pipe.execute()


def pong_batches(url: str, transitions: int, batch: int) -> tuple[FrameLayout, list]:
    """Real Pong chunks: a real Ape-X actor (initial weights) and filler fill a scratch run's
    frame replay (benchmarks/atari_bytes.py); its stored chunks, regrouped into batches of
    about ``batch`` transitions, each with its encoded chunks for the plain side."""
    client = connect(url)
    src = RunKeys("bench-pong-source")
    cfg = ApexConfig(env=ENV, steps_per_update=0, stream_maxlen=100_000)
    create_run(client, src, "apex", cfg)
    fill_from_actor(client, src, cfg, transitions)
    replay = make_replay(client, src, cfg)
    layout = replay.layout
    chunks = []
    for _, blob in client.hscan_iter(src.replay_frames):
        recs, frames = layout.parse(blob)[0], layout.chunk_frames(blob)
        chunks.append((frames, recs, blob))
    delete_run(client, src)
    client.close()
    batches, group = [], []
    for c in chunks:
        group.append(c)
        if sum(len(g[1]) for g in group) >= batch:
            recs = np.concatenate([g[1] for g in group])
            fb = FrameBatch(
                np.concatenate([g[0] for g in group]),
                np.asarray([(len(g[1]), len(g[0])) for g in group], np.int32),
                recs["refs"],
                recs["action"],
                recs["ret"],
                recs["disc"],
            )
            batches.append((fb, [(g[2], len(g[1])) for g in group]))
            group = []
    return layout, batches


def used_memory(client: redis.Redis) -> int:
    """Redis's ``used_memory``, summed over a cluster's nodes."""
    if isinstance(client, RedisCluster):
        per_node = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return sum(v["used_memory"] for v in per_node.values())
    return client.info("memory")["used_memory"]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--where", nargs="+", default=["node", "cluster"], choices=["node", "cluster"])
    ap.add_argument("--capacity", type=int, default=100_000, help="transitions, all shards")
    ap.add_argument("--batch", type=int, default=256, help="transitions per insert and sample")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds, median taken")
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds per round and side")
    ap.add_argument("--alpha", type=float, default=0.6, help="rank-mode exponent")
    ap.add_argument("--beta", type=float, default=0.4, help="IS-weight exponent")
    ap.add_argument("--sizes", nargs="+", default=["cartpole", "atari"])
    ap.add_argument("--pong", type=int, default=8192, help="real Pong transitions to replay")
    args = ap.parse_args()

    works = []
    for size in args.sizes:
        if size == "atari":
            with EmbeddedRedis() as scratch:
                works.append(atari(scratch.url, args.batch, args.pong))
        else:
            works.append(cartpole(args.batch))
    print(
        f"capacity {args.capacity:,} (all shards), batch {args.batch}, median of "
        f"{args.rounds} alternating rounds of {args.seconds:g} s; bytes moved per transition: "
        + ", ".join(f"{w.name} {w.bytes_per:.0f}" for w in works)
    )
    head = f"{'size':<8} {'where':<8} {'S':>2} {'operation':<7} {'qrl tr/s':>10} {'MB/s':>6}"
    print(f"{head} {'plain tr/s':>11} {'MB/s':>6} {'qrl/plain':>9} {'B/tr in Redis':>13}")
    for work in works:
        mb = work.bytes_per / 1e6
        for where in args.where:
            for shards in args.shards:
                with ExitStack() as stack:  # a fresh Redis for each: memory read from zero
                    if where == "node":
                        url = stack.enter_context(EmbeddedRedis()).url
                    else:
                        url = stack.enter_context(EmbeddedCluster(3)).url
                    m = measure(url, where == "cluster", shards, work, args)
                    for op, q, p in (
                        ("insert", m["q_ins"], m["p_ins"]),
                        ("sample", m["q_smp"], m["p_smp"]),
                        ("prio", m["q_pri"], m["p_pri"]),
                    ):
                        print(
                            f"{work.name:<8} {where:<8} {shards:>2} {op:<7} {q:>10,.0f} "
                            f"{q * mb:>6.1f} {p:>11,.0f} {p * mb:>6.1f} {q / p:>9.2f} "
                            f"{m['bytes']:>13.0f}",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
