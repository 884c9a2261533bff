"""``qrl train``: one command that runs a whole job on one machine.

It starts an embedded Redis (unless given a URL), writes the run's config, starts every role
as its own process (``qrl replay``, ``qrl learner ...``, ``qrl actor ...``), follows the
metrics stream with a live display, evaluates the latest published weights periodically,
stops at the target return or the time/step budget, shuts every process down and leaves a
run directory: ``config.json``, ``metrics.csv`` and TensorBoard files (:mod:`qrl.runlog`),
``logs/`` and the learner's checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table

from qrl.config import create_run, to_dict
from qrl.connection import connect
from qrl.control import StopFlag, request_stop
from qrl.embedded import EmbeddedRedis, die_with_parent
from qrl.keys import RunKeys
from qrl.metrics import MetricsReader
from qrl.runlog import Progress, RunLog

log = logging.getLogger(__name__)


@dataclass
class Role:
    """A role process: its name (for logs) and its ``qrl`` arguments."""

    name: str
    args: list[str]


@dataclass
class Budget:
    target_return: float | None = 475.0
    max_time: float | None = 90.0
    max_steps: int | None = None
    eval_every: float = 1.0
    eval_episodes: int = 10


def _table(progress: Progress, title: str) -> Table:
    t = Table(title=title, show_header=False, box=None)
    for k, val in progress.row().items():
        t.add_row(k.replace("_", " "), "-" if val is None else str(val))
    for k, val in progress.extra.items():
        t.add_row(k.replace("_", " "), f"{val:g}")
    return t


def default_run_name(algo: str, env: str, seed: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in env)
    return f"{algo}-{safe}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"


class RoleProcess:
    """One role of the job in its own OS process. On Linux it is forked from ``qrl train``
    (which has already imported torch and gymnasium, so a role starts in milliseconds, not
    the seconds a fresh interpreter takes); elsewhere it is a ``python -m qrl.cli``
    subprocess. Either way its output goes to ``logs/ROLE.log`` and it dies with us."""

    def __init__(self, role: Role, url: str, run: str, log_dir: Path) -> None:
        self.name = role.name
        argv = [*role.args, "--run", run]
        log_path = log_dir / f"{role.name}.log"
        self._proc: multiprocessing.process.BaseProcess | subprocess.Popen[bytes]
        if sys.platform.startswith("linux"):
            ctx = multiprocessing.get_context("fork")
            self._proc = ctx.Process(target=_role_main, args=(argv, url, log_path), name=role.name)
            self._proc.start()
        else:
            with log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "qrl.cli", *argv],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, "QRL_REDIS_URL": url},
                )

    def poll(self) -> int | None:
        p = self._proc
        return p.poll() if isinstance(p, subprocess.Popen) else p.exitcode

    def wait(self, timeout: float) -> int | None:
        p = self._proc
        if isinstance(p, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout)
        else:
            p.join(timeout)
        return self.poll()

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()


def _role_main(argv: list[str], url: str, log_path: Path) -> None:
    """A forked role: its own process group, output to its log, then the CLI command."""
    die_with_parent()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)  # the role installs its own
    os.environ["QRL_REDIS_URL"] = url
    from qrl.cli import main

    main(args=argv, prog_name="qrl")


def _shutdown(
    client: redis.Redis | None, keys: RunKeys, procs: dict[str, RoleProcess], grace: float
) -> None:
    if client is not None:
        with contextlib.suppress(redis.RedisError):
            request_stop(client, keys)
    deadline = time.monotonic() + grace
    for p in procs.values():
        if p.wait(max(deadline - time.monotonic(), 0.1)) is None:
            p.terminate()
    for p in procs.values():
        if p.wait(5) is None:
            p.kill()
            p.wait(5)


def run_training(
    algo: str,
    cfg: Any,
    roles: list[Role],
    evaluator: Callable[[redis.Redis, RunKeys], float | None],
    budget: Budget,
    *,
    redis_url: str | None,
    run: str,
    run_dir: Path,
    console: Console | None = None,
) -> int:
    """Run a whole job; returns the exit code: 0 if the target return was reached, 1 if the
    budget ran out first, 2 if a role failed or the job was interrupted."""
    console = console or Console(stderr=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "config.json").write_text(
        json.dumps({"algo": algo, "run": run, "config": to_dict(cfg)}, indent=2)
    )
    keys = RunKeys(run)
    server = None if redis_url else EmbeddedRedis().start()
    url = redis_url or server.url  # type: ignore[union-attr]
    procs: dict[str, RoleProcess] = {}
    client = None
    reached = False
    failed = False
    progress = Progress()
    stop = None
    try:
        client = connect(url)
        create_run(client, keys, algo, cfg)
        client.hdel(keys.control, "stop")  # a rerun of a stopped run starts afresh
        stop = StopFlag(client, keys)
        reader = MetricsReader(client, keys, from_start=True)
        for role in roles:
            procs[role.name] = RoleProcess(role, url, run, run_dir / "logs")
        console.print(
            f"[bold]qrl[/] {algo} on {getattr(cfg, 'env', '?')}: run {run!r}, "
            f"Redis {url if redis_url else 'embedded'}, "
            f"{len(roles)} processes, logs in {run_dir / 'logs'}"
        )
        next_eval = time.monotonic() + budget.eval_every
        interactive = console.is_terminal
        next_line = time.monotonic() + 5
        with (
            RunLog(run_dir) as runlog,
            Live(_table(progress, run), console=console, refresh_per_second=2, transient=False)
            if interactive
            else _Null() as live,
        ):
            while not stop():
                for msg in reader.read(block_ms=500):
                    progress.fold(msg)
                now = time.monotonic()
                elapsed = now - progress.start
                if now >= next_eval:
                    try:
                        score = evaluator(client, keys)
                    except (ValueError, RuntimeError) as e:  # e.g. weights that do not fit
                        log.warning("evaluation failed: %s", e)
                        score = None
                    eval_s = time.monotonic() - now  # evaluate at most ~20% of the time
                    if score is not None:
                        progress.eval_return = score
                        progress.best_eval = max(score, progress.best_eval or score)
                        reached = budget.target_return is not None and score >= budget.target_return
                    next_eval = time.monotonic() + max(budget.eval_every, 4 * eval_s)
                runlog.write(progress)
                if interactive:
                    live.update(_table(progress, run))
                elif now >= next_line:
                    console.print(" ".join(f"{k}={v}" for k, v in progress.row().items()))
                    next_line = now + 5
                dead = [n for n, p in procs.items() if p.poll() is not None]  # none may end early
                if dead:
                    console.print(f"[red]{', '.join(dead)} failed; see {run_dir / 'logs'}[/]")
                    failed = True
                    break
                if reached:
                    break
                if budget.max_time is not None and elapsed >= budget.max_time:
                    break
                if budget.max_steps is not None and progress.env_steps >= budget.max_steps:
                    break
            runlog.write(progress, force=True)
    except KeyboardInterrupt:
        console.print("interrupted")
        failed = True
    finally:
        _shutdown(client, keys, procs, grace=15)
        if server is not None:
            server.stop()
    row = progress.row()
    verdict = "reached" if reached else "did not reach"
    console.print(
        f"{verdict} target {budget.target_return} in {row['time_s']:.1f}s: "
        f"eval {row['eval_return']}, "
        f"{row['env_steps']} env steps, {row['updates']} updates; run dir {run_dir}"
    )
    if stop is not None and stop.local.is_set() and not reached:
        failed = True  # Ctrl-C / SIGTERM
    code = 0 if reached else 2 if failed else 1
    result = {**row, "reached": reached, "target": budget.target_return, "exit_code": code}
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return code


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *_: object) -> None:
        return None
