"""Ape-X actor scaling: total env steps/s of N ``qrl actor apex`` processes against N times
the steps/s of one.

    python benchmarks/scaling.py [--actors 1 2 4 8 16 32] [--window 10] [--warmup 3]
                                 [--envs-per-actor 32] [--quantum-ms Q] [--replays 1]
                                 [--learner] [--logs DIR]

For each N: a fresh embedded Redis, a fresh Ape-X run on ``qrl/Sleep-v0`` (``qrl/rl/simenv.py``:
a step costs 1 ms of wall time and almost no CPU; CartPole's spaces, 200-step episodes), one
``qrl replay`` and N ``qrl actor apex`` processes started as real commands (``--id auto``).
Once every actor has reported twice and ``--warmup`` seconds more have passed, each actor's
env-step counter is read from the run's metrics (the ``steps`` of its latest report,
with the report's time) at the start and the end of a ``--window``; total steps/s is the
sum of the actors' rates. The efficiency is total(N) / (N x total(1)). Goal: >= 0.85 at 32
actors on a 2-core machine.

Why a sleeping env: a real simulator spends its step in the simulator, which a cluster pays
for with more machines, so the question is whether *qrl's* work per step (inference, n-step
returns, priorities, encoding, the stream, the replay insert, Redis itself) stays small
enough that adding processes adds throughput. On 2 cores 32 actors stepping about 1000
times a second each are then limited only by that work.

Choices:

* The env's sleep is paid in 100 ms quanta (``qrl/rl/simenv.py``), not 1 ms per step: on this
  VM waking a sleeping actor costs it about 0.8 ms of CPU, so a sleep per step (or per
  10 ms) would make the env, not qrl, the CPU cost that grows with every actor. Measured in
  one actor process (16 envs), CPU per env step: 154 us sleeping in every step, 101 us in
  10 ms quanta, 69 in 50 ms, 46 in 100 ms, 37 in 200 ms, 20-26 without any sleep.
  ``--quantum-ms`` (``$QRL_SLEEP_QUANTUM_MS`` for the roles) reruns it with another quantum;
  ``--quantum-ms 0`` sleeps 1 ms in every step.
* ``envs_per_actor`` 32 (the default config has 8): the work done once per vector step (a
  batched forward pass for the actions, numpy around the step, and the weight-version
  check, a Redis round trip every 10 vector steps) is shared by 32 env steps. In one actor
  process with the 100 ms quantum: 39 us of CPU per env step with 32 envs, 44 with 16, 55
  with 8; without any sleep 20, 20 and 34. A 1000-step/s actor is then 96% asleep.
  ``actor_batch`` stays 256 transitions per stream entry, and the network the default
  256-256 dueling MLP (64-64 saved under 10%), so the figure describes the configuration
  people run.
* ``steps_per_update`` 0: the run-wide rate limit ties the actors' total to the learner's
  update rate, which is what it is for, but it would make total steps/s a measure of the
  learner, not of adding actors.
* No learner by default: on 2 cores a learner's gradient loop keeps a core busy (it trains
  as fast as it can), so the actors would share what is left with it and the figure would
  say how the leftover CPU splits rather than how actors scale; with the rate limit off it
  changes nothing else for the actors but weight fetches. The benchmark publishes initial
  weights itself (actors wait for a first version); ``--learner`` adds a ``qrl learner
  apex`` for the whole pipeline.
* The stream's consumer is a real ``qrl replay`` (``--replays`` of them), so experience goes
  where it goes in a run (validated, inserted into the 100k prioritized replay, FIFO
  eviction once full); the ``backpressure`` column is the share of the actors' time spent
  waiting on a full stream, non-zero when the replay falls behind.
* ``actor cpu us/step`` is the CPU time of all actor processes (``/proc``) over their env
  steps in the window; ``machine busy`` is the whole machine's CPU use (other work included:
  the machine is shared); ``stop s`` is how long all roles took to exit after the run's stop
  flag was set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qrl.algos.apex.config import ApexConfig
from qrl.jobs.launch import reporters
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import q_network
from qrl.rl.simenv import DEFAULT_QUANTUM, QUANTUM_ENV_VAR, SLEEP_ENV, default_quantum
from qrl.runtime.control import request_stop
from qrl.runtime.metrics import MetricsReader
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis, die_with_parent
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (Linux ``/proc``); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def machine_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (``/proc/stat``)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])
    return (total - idle) / TICK, total / TICK


class Roles:
    """``qrl`` role processes (fresh interpreters, ``python -m qrl.cli``), their output in log
    files; they get SIGTERM if this process dies."""

    def __init__(self, url: str, run: str, log_dir: Path) -> None:
        self.url, self.run, self.log_dir = url, run, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "qrl.cli", "-v", *args]
        argv += ["--redis", self.url, "--run", self.run]
        with (self.log_dir / f"{name}.log").open("wb") as log:
            p = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,  # noqa: PLW1509
            )
        self.procs[name] = p
        return p

    def check(self) -> None:
        """Raise if a role exited (they run until asked to stop)."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")

    def stop(self, client: Any, keys: RunKeys, grace: float = 60.0) -> list[str]:
        """Ask the run to stop, wait, then SIGTERM and SIGKILL what is left. Returns the
        roles that did not stop by themselves or exited non-zero."""
        with contextlib.suppress(Exception):
            request_stop(client, keys)
        t0 = time.monotonic()
        bad = []
        for name, p in self.procs.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(t0 + grace - time.monotonic(), 0.1))
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                bad.append(f"{name} (still running {grace:g} s after the stop request)")
            elif p.returncode != 0:
                bad.append(f"{name} (exit {p.returncode})")
        return bad


@dataclass
class Sample:
    """Each actor's latest report (time, steps, backpressure) and CPU times at one moment."""

    wall: float
    reports: dict[int, tuple[float, float, float]]
    cpu: float
    machine: tuple[float, float]
    learner_updates: float | None = None


class Follower:
    """Folds the run's metrics into each role's latest report."""

    def __init__(self, client: Any, keys: RunKeys) -> None:
        self.reader = MetricsReader(client, keys, reporters(client, keys), from_start=True)
        self.actors: dict[int, tuple[float, float, float]] = {}
        self.reports: dict[int, int] = {}
        self.learner: float | None = None

    def poll(self, block_ms: int = 100) -> None:
        for m in self.reader.read(block_ms=block_ms):
            v = m["values"]
            if m["role"] == "actor":
                self.actors[m["id"]] = (m["time"], v["steps"], v.get("backpressure_s", 0.0))
                self.reports[m["id"]] = self.reports.get(m["id"], 0) + 1
            elif m["role"] == "learner":
                self.learner = v["updates"]

    def sample(self, pids: list[int]) -> Sample:
        """Now: the latest reports, and the CPU time of the processes ``pids`` together."""
        return Sample(
            time.time(),
            dict(self.actors),
            sum(cpu_seconds(pid) for pid in pids),
            machine_times(),
            self.learner,
        )


def measure(n: int, args: argparse.Namespace, log_root: Path) -> dict[str, float]:
    """Steps/s and costs of ``n`` actor processes over the window."""
    cfg = ApexConfig(
        env=args.env, actors=n, envs_per_actor=args.envs_per_actor, steps_per_update=0.0
    )
    log_dir = log_root / f"actors{n}"
    log_dir.mkdir()
    with EmbeddedRedis() as server:
        client = connect(server.url)
        keys = RunKeys(f"scaling-{n}")
        create_run(client, keys, "apex", cfg)
        torch.manual_seed(cfg.seed)
        net = q_network(cfg, EnvSpec.of(cfg.env))
        WeightStore(client, keys).publish(net, version=0)  # what actors wait for
        roles = Roles(server.url, keys.run, log_dir)
        follower = Follower(client, keys)
        try:
            for i in range(args.replays):
                roles.start(f"replay{i}", "replay")
            if args.learner:
                roles.start("learner", "learner", "apex", "--device", "cpu")
            actor_procs = [roles.start(f"actor{i}", "actor", "apex") for i in range(n)]
            deadline = time.monotonic() + 60 + 5 * n
            while len(follower.actors) < n or min(follower.reports.values()) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {len(follower.actors)} of {n} actors reported")
                roles.check()
                follower.poll()
            end = time.monotonic() + args.warmup
            while time.monotonic() < end:
                follower.poll()
            pids = [p.pid for p in actor_procs]
            a = follower.sample(pids)
            end = time.monotonic() + args.window
            while time.monotonic() < end:
                follower.poll()
            roles.check()
            b = follower.sample(pids)
        finally:
            t_stop = time.monotonic()
            bad = roles.stop(client, keys)
            t_stop = time.monotonic() - t_stop
        if bad:
            print(f"  warning: {n} actors: {', '.join(bad)}; logs in {log_dir}", file=sys.stderr)

    rates, steps, waited, span = [], 0.0, 0.0, 0.0
    for ident, (t1, s1, w1) in b.reports.items():
        t0, s0, w0 = a.reports[ident]
        if t1 <= t0:  # it reports between vector steps: it was stuck (e.g. a full stream)
            print(f"  warning: actor {ident} did not report in the window", file=sys.stderr)
            rates.append(0.0)
            continue
        rates.append((s1 - s0) / (t1 - t0))
        steps += s1 - s0
        waited += w1 - w0
        span += t1 - t0
    out = {
        "total": sum(rates),
        "per_actor": sum(rates) / len(rates),
        "cpu_us": (b.cpu - a.cpu) / steps * 1e6,
        "busy": (b.machine[0] - a.machine[0]) / (b.machine[1] - a.machine[1]),
        "backpressure": waited / span,
        "stop_s": t_stop,
    }
    if a.learner_updates is not None and b.learner_updates is not None:
        out["updates"] = (b.learner_updates - a.learner_updates) / (b.wall - a.wall)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--window", type=float, default=10.0, help="seconds measured per count")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds after all reported")
    ap.add_argument("--env", default=SLEEP_ENV)
    ap.add_argument("--envs-per-actor", type=int, default=32)
    ap.add_argument(
        "--quantum-ms",
        type=float,
        default=None,
        help=f"qrl/Sleep-v0's sleep quantum (sets ${QUANTUM_ENV_VAR} for the roles; 0: a "
        f"sleep per step; default {DEFAULT_QUANTUM * 1000:g})",
    )
    ap.add_argument("--replays", type=int, default=1, help="qrl replay processes")
    ap.add_argument("--learner", action="store_true", help="also run a qrl learner apex")
    ap.add_argument("--logs", type=Path, default=None, help="keep the roles' logs here")
    args = ap.parse_args()
    if args.quantum_ms is not None:
        os.environ[QUANTUM_ENV_VAR] = f"{args.quantum_ms:g}"  # inherited by the roles
    counts = sorted(set(args.actors))
    env = args.env
    if env == SLEEP_ENV:
        q = default_quantum()
        env += f" (1 ms a step, {f'slept in {q * 1000:g} ms quanta' if q else 'each slept'})"
    print(
        f"{env}, {args.envs_per_actor} envs/actor, "
        f"steps_per_update 0, {args.replays} qrl replay, "
        f"{'a' if args.learner else 'no'} learner, {os.cpu_count()} CPUs; "
        f"{args.window:g} s window after {args.warmup:g} s warm-up; "
        f"load average {os.getloadavg()[0]:.1f} at the start",
        flush=True,
    )
    header = (
        f"{'actors':>6} {'steps/s':>9} {'per actor':>9} {'efficiency':>10} "
        f"{'actor cpu us/step':>17} {'machine busy':>12} {'backpressure':>12}"
    )
    header += f" {'stop s':>6}"
    if args.learner:
        header += f" {'updates/s':>9}"
    print(header, flush=True)
    base: float | None = None
    results = {}
    with contextlib.ExitStack() as stack:
        if args.logs is None:
            args.logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qrl-")))
        for n in counts:
            r = measure(n, args, args.logs)
            results[n] = r
            base = base if base is not None else r["total"] / n
            eff = r["total"] / (n * base)
            line = (
                f"{n:>6} {r['total']:>9,.0f} {r['per_actor']:>9,.0f} {eff:>10.2f} "
                f"{r['cpu_us']:>17.1f} {r['busy']:>12.0%} {r['backpressure']:>12.1%}"
                f" {r['stop_s']:>6.1f}"
            )
            if args.learner:
                line += f" {r.get('updates', float('nan')):>9.1f}"
            print(line, flush=True)
    top = counts[-1]
    eff = results[top]["total"] / (top * base) if base else float("nan")
    ref = "1 actor" if counts[0] == 1 else f"{counts[0]} actors"
    print(f"efficiency at {top} actors (against {ref}): {eff:.2f}   goal >= 0.85")


if __name__ == "__main__":
    main()
