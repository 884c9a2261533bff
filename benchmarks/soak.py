"""Bounded memory: Ape-X for 20 minutes, Redis ``used_memory`` and every process's RSS each
minute; after warm-up both must stay flat (within 10%).

    python benchmarks/soak.py [--minutes 20] [--warmup 5] [--env CartPole-v1]

It starts an embedded Redis, then ``qrl train apex`` against it with no target (so it runs
the whole time) and the default config: 2 actors x 8 envs, one replay role, a 100k
replay that starts evicting after about a minute. Every minute it records Redis
``used_memory`` and the resident set size of the ``qrl train`` process and each of its
descendants (roles, the learner's sampler), read from ``/proc``. The verdict compares the
largest and smallest sample of each series after the warm-up minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from qrl.server.embedded import EmbeddedRedis


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(fields[1]), []).append(int(entry.name))
    return kids


def _rss_tree(root: int) -> dict[str, int]:
    """RSS in bytes of ``root`` and its descendants, keyed by role and pid."""
    kids, out, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        rss = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")), 0)
        role = "qrl train" if pid == root else "role" if pid in kids.get(root, []) else "sampler"
        out[f"{role} (pid {pid})"] = int(rss) * 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="minutes before the flatness check")
    ap.add_argument("--env", default="CartPole-v1")
    args = ap.parse_args()
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        run_dir = Path("runs") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
        train = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qrl.cli",
                "train",
                "apex",
                "--env",
                args.env,
                "--redis",
                server.url,
                "--run",
                "soak",
                "--run-dir",
                str(run_dir),
                "--target-return",
                "1e9",
                "--max-time",
                str(args.minutes * 60 + 30),
                "--eval-every",
                "60",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        redis_mem: list[int] = []
        rss: list[dict[str, int]] = []
        try:
            start = time.monotonic()
            print(f"{'minute':>6} {'redis MiB':>10} {'processes MiB':>14}  per process MiB")
            for minute in range(1, args.minutes + 1):
                time.sleep(max(0.0, start + 60 * minute - time.monotonic()))
                if train.poll() is not None:
                    sys.exit(f"qrl train exited early with {train.returncode}; see {run_dir}")
                redis_mem.append(int(client.info("memory")["used_memory"]))
                rss.append(_rss_tree(train.pid))
                per = " ".join(f"{v / 2**20:.0f}" for v in rss[-1].values())
                print(
                    f"{minute:>6} {redis_mem[-1] / 2**20:>10.1f} "
                    f"{sum(rss[-1].values()) / 2**20:>14.1f}  {per}",
                    flush=True,
                )
        finally:
            train.terminate()
            train.wait(60)
    steady = slice(args.warmup, None)
    series = {"redis used_memory": redis_mem[steady]}
    for name in rss[args.warmup] if len(rss) > args.warmup else []:
        series[name] = [r[name] for r in rss[steady] if name in r]
    ok = True
    print(f"\nafter minute {args.warmup}: max/min of each series (goal <= 1.10)")
    for name, values in series.items():
        if len(values) < 2:
            continue
        ratio = max(values) / max(min(values), 1)
        ok &= ratio <= 1.10
        print(f"  {ratio:5.3f}  {name}")
    print("flat" if ok else "NOT flat")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
