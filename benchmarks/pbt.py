"""Population-based training against random search: time to the population's first solve.

    python benchmarks/pbt.py --seeds 0 1 2              # PPO on LunarLander-v3 (issue 34's run)
    python benchmarks/pbt.py --env Acrobot-v1 --slots 2 --max-time 600

For each seed, the same `qrl pbt` population twice, one after the other (whole processes,
each with its embedded Redis): with exploit and explore (PBT), and with `--random-search`
(the same trials with the same initial draws from deliberately wide ranges, the same slots
and segments, never a copy). Both stop at the first trial confirmed at the target over 100
fresh episodes, or at the time budget; total env steps are what the slots manage in that
time, equal for equal time. A population that does not solve counts as its budget (medians
stay honest). Prints each time, each seed's ratio (also in segments trained, a unit the
machine's speed drifting during the run leaves alone) and the ratio of medians PBT / random
search (issue 34's goal: <= 0.6); each PBT run's lineage plot is left in its run dir.

The defaults put four trials on one slot (a PPO segment's actors and learner fill this
2-core machine): random search then trains each trial a quarter of the time, while PBT's
exploits move the slot's turns to copies of the best lineage. The more trials per slot, the
more wall time PBT can save; with as many slots as trials only better explored values
can save any. A trial ranks only after a burn-in of six segments of its own: the first
ranking of draws this wide can put a policy that collapsed at once (a steady -130) above the
one draw still learning, and every trial then descends from the collapsed one. `--quantile
0.75 --resample 0` (every trial below the top copies it, perturbing only) moves more turns
to the best lineage, but leaves nothing to fall back on when that lineage diverges
(notes/benchmarks-notebook.md, "Every trial below the top copying it, perturbing only").
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

EXPLORE = ["lr=1e-5..1e-1:log", "entropy_cost=1e-4..1e-1:log"]


def run(args: argparse.Namespace, seed: int, pbt: bool, root: Path) -> tuple[float, dict]:
    name = f"{'pbt' if pbt else 'random'}-s{seed}"
    cmd = [
        sys.executable,
        "-m",
        "qrl.cli",
        "pbt",
        args.algo,
        "--env",
        args.env,
        "--seed",
        str(seed),
        "--population",
        str(args.population),
        "--slots",
        str(args.slots),
        "--ready",
        str(args.ready),
        "--max-time",
        str(args.max_time),
        "--name",
        name,
        "--run-dir",
        str(root / name),
    ]
    if args.ready_steps:
        cmd += ["--ready-steps", str(args.ready_steps)]
    if args.quantile:
        cmd += ["--quantile", str(args.quantile)]
    if args.burn_in:
        cmd += ["--burn-in", str(args.burn_in)]
    if args.resample is not None:
        cmd += ["--resample", str(args.resample)]
    for e in EXPLORE:
        cmd += ["--explore", e]
    if not pbt:
        cmd.append("--random-search")
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.max_time + 300)
    wall = time.monotonic() - start
    result = json.loads((root / name / "result.json").read_text())
    if proc.returncode != 0:
        wall = max(wall, args.max_time)
    if pbt:
        subprocess.run(
            [sys.executable, "-m", "qrl.cli", "plot", str(root / name)], capture_output=True
        )
    lineage = root / name / "lineage.jsonl"
    result["exploits"] = len(lineage.read_text().splitlines()) if lineage.exists() else 0
    # segments trained (cut-short ones left out): the run's length in the unit its schedule
    # works in, whatever the machine's speed at that hour
    result["segments"] = sum(result.get("segments", {}).values())
    return wall, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algo", default="ppo")
    p.add_argument("--env", default="LunarLander-v3")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--population", type=int, default=4)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--ready", type=float, default=30.0)
    p.add_argument(
        "--ready-steps",
        type=int,
        default=20_000,
        help="End a segment after this many env steps (--ready caps its seconds; 0: by "
        "--ready alone).",
    )
    p.add_argument(
        "--quantile",
        type=float,
        default=None,
        help="Truncation selection's quantile (default 0.25; past 0.5 the rest copy the top "
        "1 - quantile).",
    )
    p.add_argument(
        "--resample",
        type=float,
        default=None,
        help="Chance an explored value is redrawn instead of perturbed (default 0.25).",
    )
    p.add_argument(
        "--burn-in",
        type=int,
        default=6,
        help="Segments a trial trains before it ranks (PBT only; random search never copies; "
        "0: none).",
    )
    p.add_argument("--max-time", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None, help="Keep the run dirs here.")
    args = p.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="qrl-pbt-"))
    times: dict[bool, list[float]] = {True: [], False: []}
    segments: dict[bool, int] = {}
    for seed in args.seeds:
        for pbt in (True, False):
            wall, result = run(args, seed, pbt, root)
            times[pbt].append(wall)
            segments[pbt] = result["segments"]
            solved = result.get("solved") or {}
            print(
                f"seed {seed} {'pbt   ' if pbt else 'random'}: {wall:7.1f} s, solved by "
                f"{solved.get('trial', '-')} ({solved.get('return', '-')}), "
                f"{result['exploits']} exploits, {result['segments']} segments",
                flush=True,
            )
        print(
            f"seed {seed} ratio pbt/random {times[True][-1] / times[False][-1]:.2f} (in "
            f"segments {segments[True] / max(segments[False], 1):.2f})",
            flush=True,
        )
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"median pbt {a:.1f} s, random search {b:.1f} s: ratio {a / b:.2f} (goal <= 0.6); "
        f"run dirs in {root}"
    )


if __name__ == "__main__":
    main()
