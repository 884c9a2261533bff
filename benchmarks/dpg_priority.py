"""How large the learner's priorities (|TD error|) get in an Ape-X DPG run, against the
constant ``initial_priority`` (1000) its actors give new transitions: ``qrl train apex-dpg``
on a private Redis while this polls the replay every second for the largest priority the
learner wrote (below ``initial_priority``) and how many transitions still wait at it.

    python benchmarks/dpg_priority.py --env Pendulum-v1 --seeds 0 1 2

In rank mode only the order of priorities counts: while every learned priority stays below
``initial_priority``, a new transition ranks first, exactly as it would under "the replay's
current maximum" (the Ape-X paper's choice for actors that hold no critic)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import redis

from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys


def watch(
    client: redis.Redis, keys: RunKeys, initial: float, stop: threading.Event, seen: dict
) -> None:
    seen.update(max_learned=0.0, waiting_at_initial=[0])
    while not stop.wait(1.0):
        top = client.zrevrangebyscore(
            keys.replay_priorities, f"({initial}", "-inf", start=0, num=1, withscores=True
        )
        if top:
            seen["max_learned"] = max(seen["max_learned"], top[0][1])
        waiting = client.zcount(keys.replay_priorities, initial, initial)
        seen["waiting_at_initial"].append(waiting)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--env", default="Pendulum-v1")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--target-return", default="-200")
    ap.add_argument("--budget", default="300")
    ap.add_argument("--initial-priority", type=float, default=1000.0)
    args = ap.parse_args()
    for seed in args.seeds:
        run = f"dpg-prio-{seed}"
        with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
            client, stop, out = redis.Redis.from_url(server.url), threading.Event(), {}
            poll = threading.Thread(
                target=watch, args=(client, RunKeys(run), args.initial_priority, stop, out)
            )
            poll.start()
            cmd = [
                sys.executable,
                "-m",
                "qrl.cli",
                "train",
                "apex-dpg",
                "--env",
                args.env,
                "--seed",
                str(seed),
                "--redis",
                server.url,
                "--run",
                run,
                "--target-return",
                args.target_return,
                "--max-time",
                args.budget,
                "--run-dir",
                str(Path(tmp) / "run"),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            stop.set()
            poll.join()
        waiting = out["waiting_at_initial"]
        print(
            f"seed {seed}: exit {done.returncode}, largest learned priority "
            f"{out['max_learned']:.1f} (initial {args.initial_priority:g}); transitions "
            f"waiting at the initial priority: median {sorted(waiting)[len(waiting) // 2]}, "
            f"max {max(waiting)} of the polls",
            flush=True,
        )


if __name__ == "__main__":
    main()
