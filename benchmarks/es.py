"""ES throughput: worker env steps/s with and without Redis coordination, and generations/s
with 1, 2 and 4 worker processes.

    python benchmarks/es.py [--seconds 3] [--rounds 3] [--gen-seconds 20]

* Coordination overhead: the same ``ESWorker`` loop, once as it runs (encoding results,
  bounded XADD, polling the generation), once with pushing and polling replaced by no-ops.
  Rounds alternate; the ratio is with / without (goal >= 0.95).
* Scaling: a real ``qrl es master`` and N ``qrl es worker`` processes on an embedded Redis
  (CartPole-v1, default config); generations/s over a window after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from qrl.actors.es import ESWorker
from qrl.algos.es.config import ESConfig
from qrl.algos.es.keys import es_params, es_results
from qrl.runtime.control import request_stop
from qrl.runtime.loop import run_role
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore


class OfflineWorker(ESWorker):
    """The same evaluation loop with Redis taken out: results are dropped, no polling."""

    def push(self, should_stop):  # type: ignore[no-untyped-def]
        self.done_pairs = []
        return True

    def __init__(self, *args, **kw):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw, poll_every=1e12)


def steps_rate(worker: ESWorker, seconds: float) -> float:
    start, s0 = time.perf_counter(), worker.steps
    stop = lambda: time.perf_counter() - start > seconds  # noqa: E731
    run_role(worker, worker.client, worker.keys, 0, stop, report_every=1e9)
    return (worker.steps - s0) / (time.perf_counter() - start)


def coordination(url: str, cfg: ESConfig, seconds: float, rounds: int) -> tuple[float, float]:
    client = connect(url)
    keys = RunKeys("bench-es")
    create_run(client, keys, "es", cfg)
    from qrl.learners.es import ESMaster

    ESMaster(lambda: connect(url), keys, cfg).publish()  # generation 0 for the workers
    online = ESWorker(client, keys, cfg, 0)
    online.producer.maxlen = 10**9  # no master consuming: the stream is cleared each round
    offline = OfflineWorker(client, keys, cfg, 1)
    on, off = [], []
    for _ in range(rounds):
        on.append(steps_rate(online, seconds))
        client.delete(es_results(keys))
        off.append(steps_rate(offline, seconds))
    return statistics.median(on), statistics.median(off)


def generations_per_s(n_workers: int, seconds: float, warmup: float = 5.0) -> float:
    with EmbeddedRedis() as server:
        client = connect(server.url)
        keys = RunKeys(f"bench-es-{n_workers}")
        create_run(client, keys, "es", ESConfig(workers=n_workers))
        env = {**os.environ, "QRL_REDIS_URL": server.url}
        cmd = [sys.executable, "-m", "qrl.cli", "es"]
        procs = [subprocess.Popen([*cmd, "master", "--run", keys.run], env=env)]
        procs += [
            subprocess.Popen([*cmd, "worker", "--run", keys.run, "--id", str(i)], env=env)
            for i in range(n_workers)
        ]
        store = WeightStore(client, keys, es_params(keys))
        try:
            time.sleep(warmup)
            g0, t0 = store.version(), time.perf_counter()
            time.sleep(seconds)
            return (store.version() - g0) / (time.perf_counter() - t0)
        finally:
            request_stop(client, keys)
            for p in procs:
                p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per round and side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen-seconds", type=float, default=20.0, help="window per worker count")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    cfg = ESConfig()
    with EmbeddedRedis() as server:
        on, off = coordination(server.url, cfg, args.seconds, args.rounds)
    print(f"CartPole-v1, population {cfg.population}, {cfg.envs_per_worker} envs per worker")
    print(f"worker env steps/s with Redis {on:,.0f}, without {off:,.0f}: ratio {on / off:.2f}")
    for n in args.workers:
        print(
            f"{n} worker(s): {generations_per_s(n, args.gen_seconds):.2f} generations/s", flush=True
        )


if __name__ == "__main__":
    main()
