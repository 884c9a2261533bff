"""Sharded replay throughput: qrl's replay with 1, 2 and 3 shards (``replay_shards``), on one
Redis node and on a local 3-node Redis Cluster, each beside a plain pipelined redis-py loop
doing the same Redis work on keys of the same hash tags (so the same nodes).

    python benchmarks/shards.py [--shards 1 2 3] [--where node cluster]
                                [--capacity 100000] [--batch 256] [--rounds 3] [--seconds 1]

The transitions are CartPole-sized: obs (4,) float32, a 44-byte record (the sizes of
Atari transitions, as the frame replay stores them, are in ``benchmarks/atari_bytes.py``).
Every shard is first filled to its capacity (``--capacity`` / S), untimed; then, in
alternating rounds (median of ``--rounds``), transitions/s and MB/s of records for:

Redis bytes per transition: ``used_memory`` (summed over a cluster's nodes) grown by
filling qrl's shards, over the transitions they hold.

* insert, qrl: producer batches of ``--batch`` go to the shards in turn, as the fillers
  insert them: ``PrioritizedReplay.insert`` of the shard (one Lua script: ZADD + HSET and,
  at capacity, the FIFO eviction of as many, ZREM + HDEL);
* insert, plain: the same batches to the same shards, one pipeline each of ZADD + HSET +
  ZREM + HDEL of the oldest (what qrl's script does at capacity), no Lua;
* sample, qrl: ``ShardedReplay.sample`` in rank mode, a batch of ``--batch`` across all
  shards (each shard's share in proportion to its size, one Lua call per shard: ZRANGE per
  rank + HMGET), record decoding and IS weights;
* sample, plain: per shard, one pipeline of ZRANGE <r> <r> REV WITHSCORES for its share of
  the batch, then one HMGET; the ranks are drawn beforehand, untimed.

On a cluster both sides use a cluster client (qrl's ``connect``, redis-py's ``RedisCluster``
for the plain side); the client, in this one process, does all of it. On 2 cores the client is
the bound: the Redis servers share the same cores (see docs/benchmarks.md for the profile).
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack

import numpy as np
import redis
from redis.cluster import RedisCluster
from replay import Plain, timed, transitions  # benchmarks/replay.py, beside this file

from qrl.connection import connect
from qrl.embedded import EmbeddedRedis
from qrl.embedded_cluster import EmbeddedCluster
from qrl.keys import RunKeys
from qrl.replay.shards import ShardedReplay, shard_capacity
from qrl.replay.store import RecordLayout


def measure(url: str, cluster: bool, shards: int, args: argparse.Namespace) -> dict[str, float]:
    """Median transitions/s of each side and operation for one setting."""
    rng = np.random.default_rng(0)
    layout = RecordLayout((4,), "float32")
    pool = transitions(layout, 64, args.batch, rng)
    keys = RunKeys(f"bench-s{shards}")
    cap = shard_capacity(args.capacity, shards)
    qclient = connect(url)
    pclient = RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    replay = ShardedReplay(
        qclient, keys, layout, args.capacity, shards=shards, alpha=args.alpha, seed=1
    )
    plains = [Plain(pclient, cap, k.prefix + "plain:prio", k.prefix + "plain:data")
              for k in keys.shards(shards)]  # fmt: skip
    # fill every shard to capacity, untimed; qrl's first, to read its memory
    before = used_memory(pclient)
    for s in range(shards):
        for i in range(-(-cap // args.batch)):
            replay.parts[s].insert(*pool[i % len(pool)])
    bytes_per = (used_memory(pclient) - before) / (shards * cap)
    for s in range(shards):
        for i in range(-(-cap // args.batch)):
            records, prio = pool[i % len(pool)]
            plains[s].insert(records, prio, evict=True)
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
        records, prio = pool[i % len(pool)]
        replay.parts[i % shards].insert(records, prio)
        return len(records)

    def p_insert(i: int) -> int:
        records, prio = pool[i % len(pool)]
        plains[i % shards].insert(records, prio, evict=True)
        return len(records)

    def q_sample(i: int) -> int:
        return len(replay.sample(args.batch, args.beta).ids)

    def p_sample(i: int) -> int:
        return sum(len(p.sample(r)) for p, r in zip(plains, rank_pool[i % 64], strict=True))

    sides = {"q_ins": q_insert, "p_ins": p_insert, "q_smp": q_sample, "p_smp": p_sample}
    rates: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            rates[name].append(timed(fn, args.seconds))
    assert replay.size() == shards * cap, (replay.size(), shards * cap)
    for k in keys.shards(shards):  # leave the Redis as found
        qclient.delete(*[k.prefix + n for n in ("replay:prio", "replay:data", "replay:meta")])
        pclient.delete(k.prefix + "plain:prio")
        pclient.delete(k.prefix + "plain:data")
    qclient.close()
    pclient.close()
    return {"bytes": bytes_per, **{k: statistics.median(v) for k, v in rates.items()}}


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
    args = ap.parse_args()

    record_mb = RecordLayout((4,), "float32").size / 1e6
    print(
        f"capacity {args.capacity:,} (all shards), batch {args.batch}, obs (4,) float32 "
        f"({RecordLayout((4,), 'float32').size}-byte records), median of {args.rounds} "
        f"alternating rounds of {args.seconds:g} s"
    )
    head = f"{'where':<8} {'S':>2} {'operation':<7} {'qrl tr/s':>10} {'MB/s':>6}"
    print(f"{head} {'plain tr/s':>11} {'MB/s':>6} {'qrl/plain':>9} {'B/tr in Redis':>13}")
    for where in args.where:
        with ExitStack() as stack:
            if where == "node":
                url = stack.enter_context(EmbeddedRedis()).url
            else:
                url = stack.enter_context(EmbeddedCluster(3)).url
            for shards in args.shards:
                m = measure(url, where == "cluster", shards, args)
                for op, q, p in (("insert", m["q_ins"], m["p_ins"]),
                                 ("sample", m["q_smp"], m["p_smp"])):  # fmt: skip
                    print(
                        f"{where:<8} {shards:>2} {op:<7} {q:>10,.0f} {q * record_mb:>6.1f} "
                        f"{p:>11,.0f} {p * record_mb:>6.1f} {q / p:>9.2f} {m['bytes']:>13.0f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
