"""Replay throughput: qrl's PrioritizedReplay against a plain pipelined loop on the same Redis.

    python benchmarks/replay.py [--capacity 1000000] [--batch 512] [--rounds 5] [--seconds 1]

Starts a private ``redis-server`` (``qrl.server.embedded.EmbeddedRedis``, never the one on 6379),
fills a qrl replay and a plain sorted set + hash to ``--capacity`` CartPole-sized transitions
(obs (4,) float32, a 44-byte record), then measures, in alternating rounds (median of
``--rounds``), transitions/s for:

* insert while filling: the fill itself, batches of the two sides interleaved, timed per
  call; below capacity neither side evicts, so this is qrl's Lua insert against the bare
  ZADD + HSET pipeline on a growing set (one pass, no rounds);
* insert, qrl: ``PrioritizedReplay.insert`` (one Lua script: ZADD + HSET, and at capacity the
  FIFO eviction of as many of the oldest, ZREM + HDEL);
* insert, plain: one pipeline of ZADD (``--batch`` members) + HSET (``--batch`` fields),
  scores written with ``repr`` as qrl does; the plain set is trimmed back to ``--capacity``
  between rounds, outside the timing;
* insert, plain + evict: the same pipeline plus ZREM + HDEL of the ``--batch`` oldest ids,
  which is the raw Redis work qrl does at capacity;
* sample, qrl: ``PrioritizedReplay.sample`` in rank mode: the stratified inverse-CDF rank
  draw in numpy, one Lua script (a ZRANGE per rank, one HMGET of the records), record
  decoding and IS weights;
* sample, plain: one pipeline of ``--batch`` ZRANGE <r> <r> REV WITHSCORES, then one HMGET of
  the sampled members; its ranks are drawn beforehand from the same distribution, untimed.

Ratios are qrl / plain (goal >= 0.9), and >= 100k transitions/s each way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import redis
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from qrl.replay.store import PrioritizedReplay, RecordLayout
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys

PLAIN_PRIO = "bench:plain:prio"
PLAIN_DATA = "bench:plain:data"


class Plain:
    """The raw Redis work, pipelined, no Lua: ids are consecutive integers like qrl's."""

    def __init__(
        self, client: redis.Redis, capacity: int, prio: str = PLAIN_PRIO, data: str = PLAIN_DATA
    ) -> None:
        self.client, self.capacity = client, capacity
        self.prio, self.data = prio, data  # one hash tag, so one node of a cluster
        self.lo = self.hi = 0

    def insert(self, records: list[bytes], priorities: np.ndarray, evict: bool = False) -> None:
        n = len(records)
        first, self.hi = self.hi, self.hi + n
        ids = range(first, self.hi)
        z: list[object] = [None] * (2 * n)
        z[0::2] = map(repr, priorities.tolist())  # faster for hiredis to pack than floats
        z[1::2] = ids
        h: list[object] = [None] * (2 * n)
        h[0::2] = ids
        h[1::2] = records
        pipe = self.client.pipeline(transaction=False)
        pipe.execute_command("ZADD", self.prio, *z)
        pipe.execute_command("HSET", self.data, *h)
        if evict and self.hi - self.lo > self.capacity:
            old = list(range(self.lo, self.hi - self.capacity))
            pipe.execute_command("ZREM", self.prio, *old)
            pipe.execute_command("HDEL", self.data, *old)
            self.lo = self.hi - self.capacity
        pipe.execute()

    def trim(self) -> None:
        """Untimed: delete the oldest ids beyond capacity."""
        pipe = self.client.pipeline(transaction=False)
        for s in range(self.lo, self.hi - self.capacity, 4096):
            old = list(range(s, min(s + 4096, self.hi - self.capacity)))
            pipe.execute_command("ZREM", self.prio, *old)
            pipe.execute_command("HDEL", self.data, *old)
        pipe.execute()
        self.lo = max(self.lo, self.hi - self.capacity)

    def sample(self, ranks: list[int]) -> list[bytes]:
        pipe = self.client.pipeline(transaction=False)
        for r in ranks:
            pipe.execute_command("ZRANGE", self.prio, r, r, "REV", "WITHSCORES")
        found = pipe.execute()
        # RESP3 replies pair each member with its score, RESP2 ones are flat
        members = [m[0][0] if isinstance(m[0], list) else m[0] for m in found if m]
        return self.client.execute_command("HMGET", self.data, *members)


def transitions(layout: RecordLayout, n: int, batch: int, rng: np.random.Generator):
    """``n`` distinct prebuilt batches of (records, priorities)."""
    out = []
    for _ in range(n):
        obs = rng.standard_normal((batch, 4)).astype(np.float32)
        records = layout.pack(
            obs,
            rng.integers(0, 2, batch),
            rng.standard_normal(batch),
            np.full(batch, 0.97),
            obs + 0.01,
        )
        out.append((records, rng.gamma(1.0, 1.0, batch) + 1e-3))
    return out


def timed(fn: Callable[[int], int], seconds: float) -> float:
    """Call ``fn(i)`` (returns transitions done) until ``seconds`` pass; transitions/s."""
    done, i, start = 0, 0, time.perf_counter()
    while True:
        done += fn(i)
        i += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return done / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--capacity", type=int, default=1_000_000, help="replay size (filled first)")
    ap.add_argument("--batch", type=int, default=512, help="transitions per insert and sample")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds, median taken")
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds per round and side")
    ap.add_argument("--alpha", type=float, default=0.6, help="rank-mode exponent")
    ap.add_argument("--beta", type=float, default=0.4, help="IS-weight exponent")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    layout = RecordLayout((4,), "float32")
    pool = transitions(layout, 64, args.batch, rng)
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        replay = PrioritizedReplay(
            client, RunKeys("bench"), layout, args.capacity, alpha=args.alpha, seed=1
        )
        plain = Plain(client, args.capacity)

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f}"),
            TimeRemainingColumn(),
        )
        with Progress(*columns) as progress:
            fill_q = progress.add_task("fill qrl  ", total=args.capacity)
            fill_p = progress.add_task("fill plain", total=args.capacity)
            i, n_q, t_q, t_p = 0, 0, 0.0, 0.0
            while n_q < args.capacity or plain.hi < args.capacity:
                records, prio = pool[i % len(pool)]
                i += 1
                if n_q < args.capacity:
                    t = time.perf_counter()
                    replay.insert(records, prio)
                    t_q += time.perf_counter() - t
                    n_q += len(records)
                    progress.update(fill_q, completed=min(n_q, args.capacity))
                if plain.hi < args.capacity:
                    t = time.perf_counter()
                    plain.insert(records, prio, evict=True)
                    t_p += time.perf_counter() - t
                    progress.update(fill_p, completed=min(plain.hi, args.capacity))
        fill_rates = (n_q / t_q, plain.hi / t_p)  # interleaved batches, no eviction before full
        assert replay.size() == args.capacity == client.zcard(PLAIN_PRIO)

        # plain's ranks: same stratified rank distribution as qrl, drawn beforehand
        cdf = np.cumsum(np.arange(1, args.capacity + 1, dtype=np.float64) ** -args.alpha)
        rank_pool = []
        for _ in range(256):
            u = (np.arange(args.batch) + rng.random(args.batch)) / args.batch
            rank_pool.append(np.searchsorted(cdf, u * cdf[-1], side="right").tolist())
        replay.sample(args.batch, args.beta)  # builds qrl's CDF once, outside the timing

        def q_insert(i: int) -> int:
            records, prio = pool[i % len(pool)]
            replay.insert(records, prio)
            return len(records)

        def p_insert(i: int) -> int:
            records, prio = pool[i % len(pool)]
            plain.insert(records, prio)
            return len(records)

        def p_insert_evict(i: int) -> int:
            records, prio = pool[i % len(pool)]
            plain.insert(records, prio, evict=True)
            return len(records)

        def q_sample(i: int) -> int:
            return len(replay.sample(args.batch, args.beta).ids)

        def p_sample(i: int) -> int:
            return len(plain.sample(rank_pool[i % len(rank_pool)]))

        rates: dict[str, list[float]] = {
            k: [] for k in ("q_ins", "p_ins", "p_ins_ev", "q_smp", "p_smp")
        }
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}", flush=True)
            rates["q_ins"].append(timed(q_insert, args.seconds))
            rates["p_ins"].append(timed(p_insert, args.seconds))
            plain.trim()
            rates["p_ins_ev"].append(timed(p_insert_evict, args.seconds))
            rates["q_smp"].append(timed(q_sample, args.seconds))
            rates["p_smp"].append(timed(p_sample, args.seconds))
        assert replay.size() == args.capacity == client.zcard(PLAIN_PRIO)

        m = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"\nreplay capacity {args.capacity:,}, batch {args.batch}, obs (4,) float32, "
            f"median of {args.rounds} alternating rounds of {args.seconds:g} s"
        )
        print(f"{'operation':<36} {'qrl tr/s':>10} {'plain tr/s':>11} {'qrl/plain':>10}")
        rows = [
            ("insert while filling 0 -> capacity", *fill_rates),
            ("insert (plain: ZADD+HSET)", m["q_ins"], m["p_ins"]),
            ("insert (plain: +ZREM+HDEL evict)", m["q_ins"], m["p_ins_ev"]),
            ("sample rank (plain: ZRANGE+HMGET)", m["q_smp"], m["p_smp"]),
        ]
        for name, q, p in rows:
            print(f"{name:<36} {q:>10,.0f} {p:>11,.0f} {q / p:>10.2f}")
        client.close()


if __name__ == "__main__":
    main()
