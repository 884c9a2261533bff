"""Start-up cost of role processes for each multiprocessing start method.

``qrl train`` starts every role of a job as a child process. What it costs to get N role
processes ready (torch, gymnasium and the algorithm's actor and learner modules imported)
depends on the start method:

* ``fork`` (qrl's choice while the parent has no thread): the parent imports everything
  first and forks; the children inherit the imports.
* ``forkserver``: a server process imports :data:`qrl.jobs.launch.PRELOAD` once,
  while the parent goes on; each child is forked from that clean server.
* ``spawn``: every child is a fresh interpreter that imports everything itself.

Each measurement is a fresh parent interpreter (``python benchmarks/startup.py --method M``
run as a subprocess), timed from its own start to the moment all N children reported ready,
so the parent's imports count too. Methods alternate round by round; medians are printed.

    python benchmarks/startup.py            # 4 children, 5 rounds
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

METHODS = ("fork", "forkserver", "spawn")
ROLE_MODULES = ("qrl.actors.dqn", "qrl.learners.dqn", "qrl.replay.role")


def _child(q, t0: float, learner: bool) -> None:  # noqa: ANN001
    import importlib

    for m in ROLE_MODULES:
        importlib.import_module(m)
    if learner:  # a learner's first optimizer imports torch._dynamo
        import torch

        torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    q.put(time.time() - t0)


def measure(method: str, n: int, t0: float) -> None:
    """In a fresh interpreter: start ``n`` children with ``method``; print seconds to ready."""
    import importlib
    import multiprocessing as mp

    if method == "forkserver":  # started first: the server preloads while the parent imports
        from multiprocessing import forkserver

        from qrl.jobs.launch import PRELOAD

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()
    else:
        ctx = mp.get_context(method)
    importlib.import_module("qrl.jobs.train")  # what the parent of qrl train imports itself
    if method == "fork":  # as qrl train: import everything, then fork
        for m in ROLE_MODULES:
            importlib.import_module(m)
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(q, t0, i == 0)) for i in range(n)]
    for p in procs:
        p.start()
    ready = sorted(q.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"{ready[0]:.3f} {ready[-1]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.method:
        measure(args.method, args.children, args.t0)
        return
    first: dict[str, list[float]] = {m: [] for m in METHODS}
    last: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        for m in METHODS[r % 3 :] + METHODS[: r % 3]:
            t0 = time.time()
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--method",
                    m,
                    "--t0",
                    repr(t0),
                    "--children",
                    str(args.children),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            a, b = map(float, out.stdout.split())
            first[m].append(a)
            last[m].append(b)
    print(
        f"{args.children} role processes ready, seconds from the parent's start (median of "
        f"{args.rounds}):"
    )
    print(f"{'method':12s} {'first ready':>12s} {'all ready':>10s}")
    for m in METHODS:
        print(f"{m:12s} {statistics.median(first[m]):12.2f} {statistics.median(last[m]):10.2f}")


if __name__ == "__main__":
    main()
