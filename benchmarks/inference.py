"""Central inference (SEED) against local inference: what the acting side of an IMPALA run
delivers and what it costs the actor machines.

    python benchmarks/inference.py                      # 2, 8, 16 actors; 64-64 and 3x1024
    python benchmarks/inference.py --actors 8 --hidden 1024,1024,1024 --seconds 30
    python benchmarks/inference.py --actors 16 32 --server-device cuda   # on a GPU machine

For each network, actor count and mode, a Redis this script starts holds one IMPALA run
(CartPole-v1, the default 16 envs per actor) whose weights it publishes once; the run's
acting processes are started with the CLI (`qrl actor impala` each, or `qrl stepper impala`
each plus one `qrl inference impala`), and a thread here takes the unrolls off the stream as
a learner that never waits would. After a warm-up it measures, over a window: env steps/s
(the actors' own reports), CPU seconds per 1,000 env steps of the actor processes and of
the server (from /proc), the actors' resident memory, and the round trip p50/p99 of a step's
request (central). Every role is a whole process, as in a run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.jobs.launch import reporters
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import policy_value_net
from qrl.runtime.metrics import MetricsReader
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def drain(client, stream: str, stop: threading.Event) -> None:
    while not stop.is_set():
        rows = client.xrange(stream, count=100)
        if rows:
            client.xdel(stream, *[eid for eid, _ in rows])
        else:
            time.sleep(0.002)


def reports(client, keys: RunKeys, role: str, since: float) -> dict[int, list[dict]]:
    """Each process's reports from ``since`` on, with their times."""
    reader, out = MetricsReader(client, keys, reporters(client, keys), from_start=True), {}
    while batch := reader.read():
        for m in batch:
            if m["role"] == role and m["time"] >= since:
                out.setdefault(m["id"], []).append({**m["values"], "time": m["time"]})
    return out


def rate(by_process: dict[int, list[dict]], counter: str) -> float:
    """The summed rate of ``counter`` over the processes' first to last report."""
    total = 0.0
    for rs in by_process.values():
        if len(rs) > 1:
            total += (rs[-1][counter] - rs[0][counter]) / (rs[-1]["time"] - rs[0]["time"])
    return total


def one(url: str, mode: str, actors: int, hidden: str, args: argparse.Namespace) -> dict:
    run = f"inf-{mode}-{actors}-{hidden.replace(',', 'x')}-{int(time.time() * 1000)}"
    keys, client = RunKeys(run), connect(url)
    layers = tuple(int(h) for h in hidden.split(","))
    cfg = ImpalaConfig(inference=mode, actors=actors, hidden=layers, inference_wait_ms=args.wait_ms)
    create_run(client, keys, "impala", cfg)
    WeightStore(client, keys).publish(policy_value_net(cfg, EnvSpec.of(cfg.env)), version=0)
    env = {**os.environ, "QRL_RUN": run, "QRL_REDIS_URL": url}
    cli = [sys.executable, "-m", "qrl.cli"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    servers = []
    if mode == "central":
        serve = ["inference", "impala", "--device", args.server_device]
        serve += ["--threads", str(args.server_threads)]
        servers = [subprocess.Popen([*cli, *serve], **quiet)]
    role = "stepper" if mode == "central" else "actor"
    acting = [
        subprocess.Popen([*cli, role, "impala", "--id", str(i)], **quiet) for i in range(actors)
    ]
    stop = threading.Event()
    drainer = threading.Thread(target=drain, args=(connect(url), trajectories(keys), stop))
    drainer.start()
    try:
        deadline = time.time() + 300  # 16 processes loading torch on 2 cores take a while
        while time.time() < deadline:  # every acting process stepping
            started = reports(client, keys, role, 0.0)
            if len(started) == actors and all(rs[-1]["steps"] > 0 for rs in started.values()):
                break
            time.sleep(1.0)
        time.sleep(args.warmup)
        t0 = time.time()
        cpu0 = [cpu_s(p.pid) for p in acting], [cpu_s(p.pid) for p in servers]
        time.sleep(args.seconds)
        cpu1 = [cpu_s(p.pid) for p in acting], [cpu_s(p.pid) for p in servers]
        rss = [rss_mb(p.pid) for p in acting]
        window = time.time() - t0
    finally:
        for p in acting + servers:
            p.terminate()
        for p in acting + servers:
            p.wait(30)
        stop.set()
        drainer.join()
    acted = reports(client, keys, role, t0)
    steps_per_s = rate(acted, "steps")
    steps = steps_per_s * window
    actor_cpu = sum(b - a for a, b in zip(cpu0[0], cpu1[0], strict=True))
    server_cpu = sum(b - a for a, b in zip(cpu0[1], cpu1[1], strict=True))
    out = {
        "steps_per_s": steps_per_s,
        "actor_cpu_per_1k": 1000 * actor_cpu / max(steps, 1),
        "server_cpu_per_1k": 1000 * server_cpu / max(steps, 1),
        "actor_rss_mb": float(np.mean(rss)),
    }
    if mode == "central":
        every = [v for rs in acted.values() for v in rs]
        out["rtt_p50_ms"] = float(np.median([v["rtt_p50_ms"] for v in every]))
        out["rtt_p99_ms"] = float(np.median([v["rtt_p99_ms"] for v in every]))
        srv = [v for rs in reports(client, keys, "inference", t0).values() for v in rs]
        out["batch"] = float(np.mean([v["batch"] for v in srv])) if srv else 0.0
        out["forward_ms"] = float(np.mean([v["forward_ms"] for v in srv])) if srv else 0.0
        out["queue_ms"] = float(np.mean([v["queue_ms"] for v in srv])) if srv else 0.0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--actors", type=int, nargs="+", default=[2, 8, 16])
    p.add_argument("--hidden", nargs="+", default=["64,64", "1024,1024,1024"])
    p.add_argument("--modes", nargs="+", default=["local", "central"])
    p.add_argument("--warmup", type=float, default=5.0, help="seconds after all step")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--server-threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--server-device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--wait-ms",
        type=float,
        default=ImpalaConfig().inference_wait_ms,
        help="the server's inference_wait_ms",
    )
    args = p.parse_args()
    with EmbeddedRedis() as server:
        for hidden in args.hidden:
            for actors in args.actors:
                res = {}
                for mode in args.modes:
                    res[mode] = r = one(server.url, mode, actors, hidden, args)
                    extra = "".join(
                        f", {k} {r[k]:.2f}"
                        for k in ("rtt_p50_ms", "rtt_p99_ms", "batch", "forward_ms", "queue_ms")
                        if k in r
                    )
                    print(
                        f"{hidden} {actors:2d} actors {mode:7s}: {r['steps_per_s']:9.0f} steps/s, "
                        f"actor CPU {r['actor_cpu_per_1k']:.3f} s/1k steps, server CPU "
                        f"{r['server_cpu_per_1k']:.3f} s/1k, actor RSS {r['actor_rss_mb']:.0f} MB"
                        f"{extra}",
                        flush=True,
                    )
                if {"local", "central"} <= res.keys() and res["local"]["steps_per_s"] > 0:
                    loc, cen = res["local"], res["central"]
                    print(
                        f"{hidden} {actors:2d} actors central/local: steps/s "
                        f"{cen['steps_per_s'] / loc['steps_per_s']:.2f}, actor CPU per step "
                        f"{cen['actor_cpu_per_1k'] / loc['actor_cpu_per_1k']:.2f}, actor RSS "
                        f"{cen['actor_rss_mb'] / loc['actor_rss_mb']:.2f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
