"""Time to solve CartPole-v1 when the simulator is slow: every training step sleeps 1 ms
(`qrl/SlowCartPole-v1`), evaluation plays the unslowed CartPole-v1 on both sides.

    pip install -e ".[bench]"
    python benchmarks/slow_env.py                         # apex and impala, 1..16 actors, seed 0
    python benchmarks/slow_env.py --algos apex --actors 8 --seeds 0 1 2

qrl: `qrl train ALGO --env qrl/SlowCartPole-v1 --eval-env CartPole-v1 --actors N`, with
its defaults otherwise; baselines: SB3 DQN (beside Ape-X) and SB3 PPO (beside IMPALA) with
the rl-baselines3-zoo CartPole-v1 settings and step budgets on the same slowed env
(`solve_time.py`'s worker). Both sides follow the same rule: an evaluation mean >= 475
over 10 episodes, confirmed on 100 fresh episodes. Each run is a whole process, timed from
its start to its exit, one after the other in one invocation (take it on a quiet
machine). Prints time and env steps to solve, and each qrl time over its baseline's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SLOW, FAST = "qrl/SlowCartPole-v1", "CartPole-v1"
SOLVE_TIME = Path(__file__).with_name("solve_time.py")
BASELINE = {"apex": ("SB3 DQN", 50_000), "impala": ("SB3 PPO", 100_000)}  # zoo budgets


def run(cmd: list[str], limit: float) -> tuple[float, int, str]:
    """``cmd``'s wall time, exit code and stdout (code -1 past ``limit`` seconds)."""
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        return time.perf_counter() - start, p.returncode, p.stdout
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, -1, ""


def qrl_run(algo: str, actors: int, seed: int, budget: float, run_dir: Path) -> tuple[float, int]:
    """Seconds to solve (``inf`` if not within the budget) and env steps taken."""
    cmd = [sys.executable, "-m", "qrl.cli", "train", algo, "--env", SLOW, "--eval-env", FAST]
    cmd += ["--actors", str(actors), "--seed", str(seed), "--max-time", str(budget)]
    secs, code, _ = run(cmd + ["--run-dir", str(run_dir)], budget + 120)
    try:
        steps = json.loads((run_dir / "result.json").read_text())["env_steps"]
    except (OSError, ValueError, KeyError):
        steps = 0
    return (secs if code == 0 else float("inf")), steps


def baseline_run(algo: str, seed: int, limit: float) -> tuple[float, int]:
    """The baseline's seconds to solve (``inf`` if it did not) and env steps taken."""
    cmd = [sys.executable, str(SOLVE_TIME), "--algo", algo, "--worker", str(seed)]
    cmd += [str(BASELINE[algo][1]), "--worker-env", SLOW, FAST]
    secs, _, out = run(cmd, limit)
    try:
        res = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return float("inf"), 0
    return (secs if res["solved"] else float("inf")), int(res["steps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", nargs="+", default=["apex", "impala"], choices=sorted(BASELINE))
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--budget", type=float, default=300.0, help="seconds per qrl run")
    ap.add_argument("--baseline-limit", type=float, default=900.0, help="seconds per SB3 run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos:
            name = BASELINE[algo][0]
            theirs = []
            for seed in args.seeds:
                secs, steps = baseline_run(algo, seed, args.baseline_limit)
                theirs.append(secs)
                print(f"{name} seed {seed}: {secs:.1f}s, {steps} env steps", flush=True)
            base = statistics.median(theirs)
            for actors in args.actors:
                ours = []
                for seed in args.seeds:
                    run_dir = Path(tmp) / f"{algo}-{actors}-{seed}"
                    secs, steps = qrl_run(algo, actors, seed, args.budget, run_dir)
                    ours.append(secs)
                    print(
                        f"qrl {algo} {actors} actors seed {seed}: {secs:.1f}s, {steps} env steps",
                        flush=True,
                    )
                mine = statistics.median(ours)
                ratio = mine / base
                print(f"qrl {algo}, {actors} actors: median {mine:.1f}s = {ratio:.2f}x {name}")


if __name__ == "__main__":
    main()
