"""Throughput across emulated machines: Redis on one host, the learner (and replay, parameter
server, inference server or ES master) on another, actors on two more; every role over TLS
as its own ACL user; a chosen round trip to Redis and bandwidth per link (tests/hosts.py:
network namespaces, tbf, a delaying relay). Needs root and ``ip netns``.

    sudo python benchmarks/network.py                       # every setup, RTT and rate
    python benchmarks/network.py --setups apex impala --rtts 0 5 --rates 1e9

For each setup, RTT and rate: a fresh run (CartPole-v1, its defaults, seed 0), ``--warmup``
seconds to start, then over ``--window`` seconds env steps/s and updates/s (from the
processes' heartbeats, as ``qrl status`` reads them), the mean policy lag and the actors'
mean time to load new weights (fetch, check, load: what acting waits for); with each
number the ratio to the setup's RTT 0 at the same rate (through the relay too: the relay's
own cost is in both). The PING round trip an actor host measured through the relay is
printed with each RTT.

    python benchmarks/network.py --out rows.jsonl ...        # the rows, as JSON lines
    python benchmarks/network.py --plot docs/network.png --out rows.jsonl   # their curves

``--plot`` alone (no ``--setups`` given) draws the rows of ``--out`` and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test harness's hosts (tests/hosts.py)

from qrl.algos import ALGOS  # noqa: E402
from qrl.runtime.roles import ENV_STEPS, UPDATES  # noqa: E402
from qrl.runtime.runlog import Progress  # noqa: E402
from qrl.runtime.status import collect  # noqa: E402
from qrl.wire.keys import RunKeys  # noqa: E402
from tests.hosts import HOSTS, SETUPS, check_netns, deployment  # noqa: E402


@dataclass
class Look:
    """One look at a run: env steps and updates so far (its live processes' last reports,
    folded as ``qrl train`` folds them), the policy lag ``qrl status`` shows, and the
    weights its actors loaded so far with the seconds that took (fetch, check, load)."""

    steps: float
    updates: float
    lag: float | None
    loads: float
    load_s: float


def look(admin, run: str, algo: str) -> Look:
    keys = RunKeys(run)
    reports = ALGOS[algo].reports
    s = collect(admin, keys, weights_key=ALGOS[algo].weights_key(keys), reports=reports)
    p = Progress(reports)
    live = [proc for proc in s["processes"] if not proc["stale"]]
    for proc in live:
        p.fold(proc)
    loads = sum(proc["values"].get("weight_loads", 0) for proc in live)
    load_s = sum(proc["values"].get("weight_load_s", 0.0) for proc in live)
    return Look(p.value(ENV_STEPS) or 0.0, p.value(UPDATES) or 0.0, s["policy_lag"], loads, load_s)


def measure(
    name: str, rtt: float, rate: float, warmup: float, window: float, sets: list[str]
) -> dict:
    setup = SETUPS[name]
    with tempfile.TemporaryDirectory() as tmp, deployment(Path(tmp), HOSTS, rate, rtt) as d:
        run, logs = f"bench-{name}", Path(tmp) / "logs"
        logs.mkdir()
        more = [arg for kv in sets for arg in ("--set", kv)]
        d.launch(setup, run, logs, "--env", "CartPole-v1", "--seed", "0", *more)
        time.sleep(warmup)  # the roles start, connect and reach their pace
        t0, first = time.monotonic(), look(d.admin, run, setup.algo)
        lags = []
        while time.monotonic() - t0 < window:
            time.sleep(1.0)  # one look a second, as qrl status --watch
            lag = look(d.admin, run, setup.algo).lag
            if lag is not None:
                lags.append(lag)
        last = look(d.admin, run, setup.algo)
        secs = time.monotonic() - t0
        loads = last.loads - first.loads
        return {
            "setup": name,
            "rtt_ms": rtt,
            "rate_bps": rate,
            "ping_ms": round(d.ping_ms, 2),
            "env_steps_per_s": round((last.steps - first.steps) / secs, 1),
            "updates_per_s": round((last.updates - first.updates) / secs, 2),
            "policy_lag": round(statistics.mean(lags), 2) if lags else None,
            "weight_load_ms": round(1000 * (last.load_s - first.load_s) / loads, 2)
            if loads
            else None,
        }


def _rows(path: Path) -> list[dict]:
    """The rows ``--out`` holds (JSON lines)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def plot(rows: list[dict], path: Path) -> None:
    """Each setup's env steps/s and updates/s as a ratio to its RTT 0, against the RTT, a
    panel per measure and a line style per link rate (the last row of each point wins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = {(r["setup"], r["rate_bps"], r["rtt_ms"]): r for r in rows}
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    rates = sorted({r["rate_bps"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    measures = (("steps_ratio", "env steps/s"), ("updates_ratio", "updates (generations)/s"))
    for ax, (measure, title) in zip(axes, measures, strict=True):
        for i, setup in enumerate(setups):
            for rate, style in zip(rates, ("-", "--"), strict=False):
                mine = [(k[2], p[measure]) for k, p in points.items() if k[:2] == (setup, rate)]
                if got := sorted(mine):
                    x, y = zip(*got, strict=True)
                    label = f"{setup}, {rate / 1e6:.0f} Mbit/s"
                    ax.plot(x, y, style, marker="o", color=f"C{i}", label=label)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set(title=f"{title}, ratio to RTT 0", xlabel="round trip to Redis (ms)", ylim=(0, None))
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--setups", nargs="+", default=None, choices=list(SETUPS))
    ap.add_argument("--rtts", nargs="+", type=float, default=[0, 1, 5, 20], help="ms")
    ap.add_argument("--rates", nargs="+", type=float, default=[1e9, 1e8], help="bits/s per link")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds before measuring")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured")
    ap.add_argument("--out", type=Path, default=None, help="also append the rows (JSON lines)")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the curves of --out's rows")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a setting of the runs"
    )
    args = ap.parse_args()
    if args.plot is not None and args.out is None:
        ap.error("--plot draws the rows of --out: give it")
    if args.plot is not None and args.setups is None:
        plot(_rows(args.out), args.plot)
        return
    args.setups = args.setups or list(SETUPS)
    why = check_netns()
    if why:
        sys.exit(why)
    rtts = sorted(set(args.rtts) | {0.0})  # the baseline of every ratio
    print(
        "setup           rate      RTT  ping ms  env steps/s (x RTT 0)  updates/s (x RTT 0)"
        "  lag  weights load ms"
    )
    for name in args.setups:
        for rate in args.rates:
            base = None
            for rtt in rtts:
                row = measure(name, rtt, rate, args.warmup, args.window, args.set)
                base = base or row
                steps = row["env_steps_per_s"] / max(base["env_steps_per_s"], 1e-9)
                updates = row["updates_per_s"] / max(base["updates_per_s"], 1e-9)
                row.update(steps_ratio=round(steps, 2), updates_ratio=round(updates, 2))
                print(
                    f"{name:15} {rate / 1e6:5.0f}Mb {rtt:5.1f} {row['ping_ms']:8.2f} "
                    f"{row['env_steps_per_s']:12.1f} ({steps:4.2f}) {row['updates_per_s']:12.2f} "
                    f"({updates:4.2f}) {row['policy_lag']} {row['weight_load_ms']}",
                    flush=True,
                )
                if args.out is not None:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    if args.plot is not None:
        plot(_rows(args.out), args.plot)


if __name__ == "__main__":
    main()
