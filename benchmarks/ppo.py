"""PPO's learner pool: learning per env step with 1 and N learners, and what the all-reduce
costs.

    pip install -e ".[bench,box2d]"
    python benchmarks/ppo.py --env CartPole-v1 --seeds 0 1 2 --learners 1 2
    python benchmarks/ppo.py --env LunarLander-v3 --max-time 1200 --eval-every 30 \\
        --plot docs/ppo-lunarlander.png

Each run is a whole `qrl train ppo --learners N` job, one after the other, on a Redis this
script starts (so that every learner's own reports can be read after the job): its exit code,
wall time and env steps to the target (confirmed on 100 episodes, `qrl train`'s rule), and
from each learner's last report its all-reduce seconds, gradient steps and updates. Printed:
per run the env steps and seconds to solve and the all-reduce time per update and per
gradient step; per pool size the median env steps to solve (learning per env step: the same
batch per update is split over the learners, so the steps to solve should match within seed
noise). `--plot` draws the training return against env steps of every run.

In a job the all-reduce's time includes waiting for the slower learner to reach it (on 2
cores the learners share them with the actors). `--collective` measures the transport
alone: two idle processes form a pool through Redis and time `all_reduce_mean_` of
gradient buffers of several sizes (PPO's default 64-64 net on CartPole: 4,675 floats).

    python benchmarks/ppo.py --collective
    python benchmarks/ppo.py --env LunarLander-v3 --set max_policy_lag=0   # on-policy only
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qrl.jobs.launch import reporters
from qrl.runtime.metrics import MetricsReader
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys


def learner_reports(url: str, run: str) -> dict[int, dict[str, Any]]:
    """The last report of each learner process of ``run``."""
    client, keys = connect(url), RunKeys(run)
    reader, last = MetricsReader(client, keys, reporters(client, keys), from_start=True), {}
    while batch := reader.read():
        for m in batch:
            if m["role"] == "learner":
                last[m["id"]] = m["values"]
    return last


def one_run(url: str, args: argparse.Namespace, learners: int, seed: int, run_dir: Path) -> dict:
    run = f"ppo-bench-{learners}-{seed}-{int(time.time())}"
    cmd = [sys.executable, "-m", "qrl.cli", "train", "ppo", "--env", args.env, "--seed", str(seed)]
    cmd += ["--learners", str(learners), "--redis", url, "--run", run, "--run-dir", str(run_dir)]
    cmd += ["--max-time", str(args.max_time), "--eval-every", str(args.eval_every)]
    cmd += [a for kv in args.set for a in ("--set", kv)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.max_time + 300)
    secs = time.perf_counter() - t
    try:
        result = json.loads((run_dir / "result.json").read_text())
    except (OSError, json.JSONDecodeError):
        result = {}
    reports = learner_reports(url, run)
    per_update = [
        r["allreduce_s"] / max(r["updates"], 1) for r in reports.values() if "allreduce_s" in r
    ]
    per_grad = [
        r["allreduce_s"] / max(r["grad_steps"], 1) for r in reports.values() if "allreduce_s" in r
    ]
    return {
        "code": proc.returncode,
        "secs": secs,
        "steps": result.get("env_steps"),
        "updates": result.get("updates"),
        "allreduce_ms_per_update": 1000 * statistics.mean(per_update) if per_update else 0.0,
        "allreduce_ms_per_grad_step": 1000 * statistics.mean(per_grad) if per_grad else 0.0,
        "update_rate": (result.get("updates") or 0) / max(result.get("time_s") or secs, 1e-9),
    }


SIZES = (4_675, 70_000, 1_700_000)  # floats: PPO's CartPole net, a 256-256 MLP, Nature CNN


def _collective_worker(url: str, run: str, out: Any, calls: int) -> None:
    import torch

    from qrl.learners.group import LearnerGroup

    group = LearnerGroup.join(connect(url), RunKeys(run), 2, torch.device("cpu"))
    assert group is not None
    times = {}
    for n in SIZES:
        grads = [torch.randn(n)]
        group.all_reduce_mean_(grads)  # warm up
        t = time.perf_counter()
        for _ in range(calls):
            group.all_reduce_mean_(grads)
        times[n] = (time.perf_counter() - t) / calls
    group.close()
    out.send((group.rank, times))


def collective(calls: int = 200) -> None:
    """Time the pool's all-reduce between two idle processes on this machine."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with EmbeddedRedis() as server:
        pipes = [ctx.Pipe() for _ in range(2)]
        procs = [
            ctx.Process(target=_collective_worker, args=(server.url, "collective", w, calls))
            for _, w in pipes
        ]
        for p in procs:
            p.start()
        results = dict(r.recv() for r, _ in pipes)
        for p in procs:
            p.join()
    for n in SIZES:
        ms = [1000 * results[rank][n] for rank in sorted(results)]
        print(f"all-reduce of {n:,} float32 between 2 processes: {max(ms):.3f} ms per call")


def curve(run_dir: Path) -> tuple[list[float], list[float]]:
    steps, returns = [], []
    with (run_dir / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            if row["episodic_return"]:
                steps.append(float(row["env_steps"]))
                returns.append(float(row["episodic_return"]))
    return steps, returns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="CartPole-v1")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--learners", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-time", type=float, default=90.0)
    ap.add_argument("--eval-every", type=float, default=1.0)
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the learning curves")
    ap.add_argument("--collective", action="store_true", help="time the all-reduce alone")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    args = ap.parse_args()
    if args.collective:
        collective()
        return
    curves: dict[str, tuple[list[float], list[float]]] = {}
    solved_steps: dict[int, list[float]] = {n: [] for n in args.learners}
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for n in args.learners:
                run_dir = Path(tmp) / f"{n}-{seed}"
                r = one_run(server.url, args, n, seed, run_dir)
                solved_steps[n].append(r["steps"] if r["code"] == 0 else float("inf"))
                print(
                    f"{args.env} learners={n} seed {seed}: exit {r['code']} in {r['secs']:.1f} s, "
                    f"{r['steps']} env steps, {r['updates']} updates "
                    f"({r['update_rate']:.1f}/s), all-reduce {r['allreduce_ms_per_update']:.1f} "
                    f"ms per update, {r['allreduce_ms_per_grad_step']:.2f} ms per gradient step",
                    flush=True,
                )
                curves[f"{n} learner{'s' * (n > 1)}, seed {seed}"] = curve(run_dir)
    for n, steps in solved_steps.items():
        print(f"learners={n}: median env steps to solve {statistics.median(steps):.0f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for label, (x, y) in curves.items():
            ax.plot(x, y, label=label, linestyle="-" if label.startswith("1 ") else "--")
        ax.set_xlabel("env steps")
        ax.set_ylabel("training episode return (mean of the last 50)")
        ax.set_title(f"qrl train ppo on {args.env}: 1 vs 2 learners")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
