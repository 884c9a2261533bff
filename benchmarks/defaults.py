"""Do the defaults generalize? `qrl train ALGO --env ENV` with no `--set`, on each task of
the table below, for each seed; prints each run's exit code, wall time, env steps and the
100-episode confirmation, and whether every run of an algorithm solved within its budget.

    pip install -e ".[box2d]"
    python benchmarks/defaults.py                          # every algorithm, seeds 0 1 2
    python benchmarks/defaults.py --algos es --seeds 0     # one algorithm, one seed
    python benchmarks/defaults.py --algos apex --envs Acrobot-v1
    python benchmarks/defaults.py --algos ppo --args="--learners 2"   # more qrl train options

A run solves when `qrl train` exits 0: an evaluation mean at the target over 10 episodes,
confirmed on 100 fresh ones, within the task's budget (`--max-time`). Runs go one after the
other, whole processes, timed from start to exit (take it on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# env -> (target return, budget in seconds)
TASKS = {
    "CartPole-v1": (475.0, 90.0),
    "Acrobot-v1": (-100.0, 300.0),
    "LunarLander-v3": (200.0, 1200.0),
    "Pendulum-v1": (-250.0, 300.0),
    "qrl/CartPoleNoVel-v1": (475.0, 300.0),
}
TABLE = {
    "apex": ["CartPole-v1", "Acrobot-v1", "LunarLander-v3"],
    "impala": ["CartPole-v1", "Acrobot-v1", "LunarLander-v3"],
    "ppo": ["CartPole-v1", "Acrobot-v1", "LunarLander-v3"],
    "es": ["CartPole-v1", "Acrobot-v1", "Pendulum-v1"],
    "r2d2": ["qrl/CartPoleNoVel-v1"],
    "a3c": ["CartPole-v1", "Acrobot-v1"],
    "gorila": ["CartPole-v1"],
}


def train(
    algo: str, env: str, seed: int, run_dir: Path, more: tuple[str, ...] = ()
) -> dict[str, object]:
    """One `qrl train` run with the defaults: its exit code, wall time and result.json."""
    target, budget = TASKS[env]
    cmd = [sys.executable, "-m", "qrl.cli", "train", algo, "--env", env, "--seed", str(seed)]
    cmd += list(more)
    cmd += ["--target-return", str(target), "--max-time", str(budget), "--run-dir", str(run_dir)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget + 120)
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        code, err = -1, "timed out"
    secs = time.perf_counter() - start
    if code != 0:  # what the run said last, so a failure to start shows why
        print("\n".join(err.strip().splitlines()[-5:]), file=sys.stderr, flush=True)
    try:
        result = json.loads((run_dir / "result.json").read_text())
    except (OSError, json.JSONDecodeError):
        result = {}
    return {"code": code, "secs": secs, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", nargs="+", default=sorted(TABLE), choices=sorted(TABLE))
    ap.add_argument("--envs", nargs="+", default=None, help="only these envs of the table")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--args", default="", help="more `qrl train` options, e.g. '--learners 2'")
    args = ap.parse_args()
    verdicts = []
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos:
            for env in TABLE[algo]:
                if args.envs and env not in args.envs:
                    continue
                target, budget = TASKS[env]
                ok = True
                for seed in args.seeds:
                    run_dir = Path(tmp) / f"{algo}-{env.replace('/', '_')}-{seed}"
                    r = train(algo, env, seed, run_dir, tuple(shlex.split(args.args)))
                    ok &= r["code"] == 0
                    print(
                        f"{algo} {env} (target {target:g}, {budget:g} s) seed {seed}: "
                        f"exit {r['code']} in {r['secs']:.1f} s, {r.get('env_steps')} env "
                        f"steps, last eval {r.get('eval_return')}, confirmation "
                        f"{r.get('confirm_return')}",
                        flush=True,
                    )
                verdicts.append(f"{algo} {env}: {'PASS' if ok else 'FAIL'}")
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
