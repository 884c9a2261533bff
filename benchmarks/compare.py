"""Time to solve, two checkouts of qrl side by side: ``qrl train ALGO --seed S`` from each,
alternating A B A B per seed, in one run (the machine's speed drifts; pairs share it).

    git worktree add /tmp/qrl-old <old commit>
    python benchmarks/compare.py --a /tmp/qrl-old --b . --algos apex impala es --seeds 0 1 2

Two settings of one checkout side by side: the same tree twice, with ``--args`` for both
and ``--a-args``/``--b-args`` for each side, e.g. ``--a . --b . --algos apex-dpg --args
"--env Pendulum-v1 --target-return -200" --b-args "--set grad_clip=1e9" --budget 300``.

Each run is a whole process (``python -m qrl.cli train``, imports included) with its
checkout's own code first on ``sys.path``; a run that does not solve counts as its budget.
Prints every time, the medians per algorithm and the ratio B / A (below 1: B is faster).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def solve(tree: Path, algo: str, seed: int, budget: float, extra: list[str]) -> tuple[float, bool]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "qrl.cli",
            "train",
            algo,
            "--seed",
            str(seed),
            "--max-time",
            str(budget),
            "--run-dir",
            str(Path(tmp) / "run"),
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("QRL_")}  # embedded Redis
        env["PYTHONPATH"] = str(tree)
        t = time.perf_counter()
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        secs = time.perf_counter() - t
    return (secs if p.returncode == 0 else max(secs, budget)), p.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="first checkout (e.g. the old main)")
    ap.add_argument("--b", type=Path, required=True, help="second checkout (e.g. the new main)")
    ap.add_argument("--algos", nargs="+", default=["apex", "impala", "es"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--budget", type=float, default=90.0)
    ap.add_argument("--args", default="", help="more `qrl train` arguments, both sides")
    ap.add_argument("--a-args", default="", help="more `qrl train` arguments, side A only")
    ap.add_argument("--b-args", default="", help="more `qrl train` arguments, side B only")
    args = ap.parse_args()
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    extra = {
        s: shlex.split(args.args) + shlex.split(getattr(args, f"{s.lower()}_args")) for s in trees
    }
    print(f"A = {trees['A']} {extra['A']}\nB = {trees['B']} {extra['B']}")
    for algo in args.algos:
        times: dict[str, list[float]] = {"A": [], "B": []}
        for i, seed in enumerate(args.seeds):
            order = ("A", "B") if i % 2 == 0 else ("B", "A")
            for side in order:
                secs, ok = solve(trees[side], algo, seed, args.budget, extra[side])
                times[side].append(secs)
                print(
                    f"{algo} seed {seed} {side}: {secs:.1f}s {'' if ok else '(not solved)'}",
                    flush=True,
                )
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"{algo}: median A {a:.1f}s, B {b:.1f}s, ratio B/A {b / a:.2f}", flush=True)


if __name__ == "__main__":
    main()
