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

from qrl.runtime.metrics import MetricsReader
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys


def learner_reports(url: str, run: str) -> dict[int, dict[str, Any]]:
    """The last report of each learner process of ``run``."""
    reader, last = MetricsReader(connect(url), RunKeys(run), from_start=True), {}
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
        "update_rate": statistics.mean(r.get("updates_per_s", 0.0) for r in reports.values())
        if reports
        else 0.0,
    }


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
    args = ap.parse_args()
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
