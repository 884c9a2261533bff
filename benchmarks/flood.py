"""A flood of junk: how fast a stream consumer rejects entries a writer adds as fast as it can.

    python benchmarks/flood.py --entries 20000 --rounds 3

A writer with a run's keys adds ``--entries`` junk entries to a stream in pipelined XADDs
(what ``tests/_key_attacker.py`` does every two seconds); a ``StreamConsumer`` asked for one
entry at a time (as the IMPALA and PPO loaders ask) reads, dead-letters and deletes them
all. Both against a fresh ``redis-server``, side by side in each round; prints the writer's
and the consumer's entries/s and their ratio (consumer / writer: above 1 and no flood keeps
producers out of the stream for good).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import redis

from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import unroll_schema
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamConsumer


def round_(client: redis.Redis, entries: int) -> tuple[float, float]:
    client.flushall()
    keys = RunKeys("flood")
    stream = trajectories(keys)  # CartPole's unrolls, as `qrl train impala` reads them
    schema = unroll_schema((4,), "float32", 2, unroll=20, envs=8)
    consumer = StreamConsumer(client, keys, stream, schema, count=1, block_ms=0)
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i in range(entries):
        pipe.xadd(stream, {"d": b"junk"})
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    added = time.perf_counter() - start
    start = time.perf_counter()
    while consumer.rejected < entries:
        consumer.read()
    return entries / added, entries / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--entries", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)  # one warning per reason: not the measurement
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        rates = [round_(client, args.entries) for _ in range(args.rounds)]
    for i, (w, c) in enumerate(rates):
        print(
            f"round {i}: writer {w:9,.0f} entries/s, consumer {c:8,.0f} rejected/s, "
            f"ratio {c / w:.3f}"
        )
    ratio = statistics.median(c / w for w, c in rates)
    print(f"median consumer / writer: {ratio:.3f}")


if __name__ == "__main__":
    main()
