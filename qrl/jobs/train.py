"""``qrl train``: one command that runs a whole job on one machine.

It starts an embedded Redis (unless given a URL), writes the run's config, starts every
process of the algorithm's roles (:func:`qrl.jobs.launch.start_process`), follows the run's
metrics with a live display, evaluates the latest published weights periodically, stops at
the target return (confirmed on ``confirm_episodes`` fresh episodes, 100 by default:
gymnasium's definition of solving CartPole-v1) or the time/step budget, shuts every
process down and leaves a run directory: ``config.json``, ``metrics.csv`` and TensorBoard
files (:mod:`qrl.runtime.runlog`), ``logs/``, ``result.json`` and the checkpoint of the role
that keeps one (the learner's: holding the weights that reached the target, when they did).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from qrl.algos import Algorithm
from qrl.jobs.acl import process_users
from qrl.jobs.launch import RoleSpec, start_process
from qrl.rl.envspec import EnvSpec
from qrl.runtime.checkpoint import replace_model
from qrl.runtime.control import StopFlag, clear_stop, request_stop
from qrl.runtime.files import write_json
from qrl.runtime.live import LiveConfig
from qrl.runtime.metrics import MetricsReader
from qrl.runtime.roles import ENV_STEPS, EVAL_RETURN, TIME, UPDATES
from qrl.runtime.runlog import Progress, RunLog
from qrl.runtime.runs import create_run
from qrl.runtime.tracking import Tracking
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import (
    RedisUnavailable,
    connect,
    disconnect,
    read_password_file,
    redact,
    with_user,
)
from qrl.wire.keys import RunKeys
from qrl.wire.weights import Weights, WeightStore

log = logging.getLogger(__name__)


@dataclass
class Budget:
    target_return: float | None = 475.0
    max_time: float | None = 90.0
    max_steps: int | None = None
    eval_every: float = 1.0
    eval_episodes: int = 10
    confirm_episodes: int = 100  # an evaluation that reaches the target is confirmed on these
    eval_env: str | None = None  # evaluate on this env id instead of the training env


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


class Evaluator:
    """Evaluation of the latest published parameters (only when they changed); ``last`` is
    the :class:`qrl.wire.weights.Weights` evaluated last."""

    def __init__(self, algo: Algorithm, cfg: Any, episodes: int, env: str | None = None) -> None:
        self.algo, self.cfg, self.episodes = algo, cfg, episodes
        self.env = env or cfg.env
        self.spec: EnvSpec | None = None  # of the env trained on, read at the first play
        self.last: Weights | None = None
        self.seen = -1  # the newest version fetched, whether it could be evaluated or not

    def __call__(self, client: redis.Redis, keys: RunKeys) -> float | None:
        """The mean return of the parameters published since the last call, or ``None``
        if none were."""
        import torch

        torch.set_num_threads(1)  # this process only evaluates: the cores are the roles'

        store = WeightStore(client, keys, self.algo.weights_key(keys))
        w = store.fetch(self.seen)
        if w is None:
            return None
        self.seen = w.version
        score = self.play(w, self.episodes, self.cfg.seed * 1000 + 7)  # ValueError: no fit
        self.last = w
        return score

    def confirm(self, episodes: int) -> float:
        """The mean return of the last evaluated parameters over ``episodes`` fresh episodes
        (seeds no periodic evaluation uses), with a fresh policy."""
        assert self.last is not None
        return self.play(self.last, episodes, 1_000_000 + self.cfg.seed * 10_000)

    def play(self, w: Weights, episodes: int, seed: int) -> float:
        """The mean return of a fresh greedy policy of ``w`` over ``episodes`` episodes
        (seeds ``seed + i``) of the evaluation env."""
        import numpy as np

        from qrl.rl.evaluate import evaluate

        if self.spec is None:
            self.spec = EnvSpec.of(self.cfg.env)
        act = self.algo.policy(self.cfg, self.spec, w.params)
        return float(np.mean(evaluate(self.env, act, episodes, seed=seed)))


def confirm(evaluator: Evaluator, budget: Budget, score: float, console: Console) -> float | None:
    """Confirm an evaluation that reached the target on fresh episodes (``None``: no
    confirmation asked for); a lucky evaluation is not a solve, so training goes on."""
    n, target = budget.confirm_episodes, budget.target_return
    if n <= 0 or target is None:
        return None
    console.print(f"eval {score:.1f} reached target {target}: confirming on {n} fresh episodes")
    mean = evaluator.confirm(n)
    console.print(
        f"{n}-episode mean {mean:.1f}: "
        + ("confirmed" if mean >= target else "not confirmed, training on")
    )
    return mean


# the usual bar for envs whose registration has no reward threshold
TARGETS = {"Pendulum-v1": -200.0}


def default_target(env: str) -> float | None:
    """The env's reward threshold from its gymnasium registration, else :data:`TARGETS`'."""
    import gymnasium as gym

    from qrl.rl.envs import find_spec

    try:
        threshold = find_spec(env).reward_threshold
    except (gym.error.Error, ImportError):
        return None
    return threshold if threshold is not None else TARGETS.get(env)


def _last_line(path: Path, tail: int = 4096) -> str:
    """The last line of a role's log that is not blank ('' if there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    return "".join(c if c.isprintable() else "?" for c in last)  # printed as text, not markup


def _shutdown(
    client: redis.Redis | None, keys: RunKeys, procs: dict[str, BaseProcess], grace: float
) -> None:
    if client is not None:
        with contextlib.suppress(redis.RedisError, RedisUnavailable):  # roles stop anyway
            request_stop(client, keys)
    deadline = time.monotonic() + grace
    for p in procs.values():
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.exitcode is None:
            p.terminate()
    for p in procs.values():
        p.join(5)
        if p.exitcode is None:
            p.kill()
            p.join(5)


def run_training(
    algo: Algorithm,
    cfg: Any,
    budget: Budget,
    *,
    redis_url: str | None,
    run: str,
    run_dir: Path,
    device: str = "auto",
    console: Console | None = None,
    tracking: Tracking | None = None,
    nice: int = 0,
    snapshot: bool = False,
    interrupted: threading.Event | None = None,
    on_tick: Callable[[], None] | None = None,
    acl: bool = False,
) -> int:
    """Run a whole job; returns the exit code: 0 if the target return was reached (with no
    target: if the whole budget ran), 1 if the budget ran out first, 2 if a role failed or the
    job was interrupted. A job that reached its target leaves the weights that reached it in
    its checkpoint. The processes of the roles that declare ``nice`` (actors) run ``nice`` steps
    nicer than the rest (the learner first on a shared machine). ``snapshot``: the learner
    resumes from the run's snapshot in Redis and saves its state there as it stops
    (population-based training's trials);
    ``interrupted``: the event SIGINT/SIGTERM set (the caller's, to see them too);
    ``on_tick``: called about every half second while the job runs (a PBT slot's lease);
    ``acl``: every process connects as a Redis ACL user of its own (passwords in
    ``run_dir/acl``), the job itself as the user of ``redis_url``."""
    console = console or Console(stderr=True)
    evaluator = Evaluator(algo, cfg, budget.eval_episodes, budget.eval_env)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    run_config = {"algo": algo.name, "run": run, "config": cfg.to_dict()}
    write_json(run_dir / "config.json", run_config)  # not through a planted link
    keys = RunKeys(run)
    checkpoint = run_dir / "checkpoint.pt"
    # the embedded Redis has a password of its own: no other user of the machine gets in,
    # and a QRL_REDIS_PASSWORD meant for another Redis does not apply to it
    server = None if redis_url else EmbeddedRedis(password=secrets.token_urlsafe(16)).start()
    url = redis_url or server.url  # type: ignore[union-attr]
    procs: dict[str, BaseProcess] = {}
    client = None
    reached = False
    failed = False
    why: dict[str, str] = {}  # a failed role: the last line of its log
    confirmed: float | None = None  # the last confirmation's mean return
    progress = Progress(algo.reports)
    stop = None
    try:
        client = connect(url)
        create_run(client, keys, algo.name, cfg)
        clear_stop(client, keys)  # a rerun of a stopped run starts afresh
        # its stop polls also record each live config change in the run dir
        live = LiveConfig(client, keys, cfg, run_dir / "config_changes.jsonl")
        stop = StopFlag(client, keys, live=live, local=interrupted)
        # from now, before any role starts: a rerun of a run (a PBT trial's next segment)
        # counts its own work, not what earlier jobs of the run reported
        reader = MetricsReader(client, keys, algo.reporters(cfg))
        users = process_users(client, algo, keys, cfg, run_dir / "acl") if acl else {}
        disconnect(client)  # forked roles inherit no open connection
        for role, i in algo.processes(cfg):
            name = f"{role.name}{i}" if role.count else role.name
            user = users.get((role.name, i))
            spec = RoleSpec(
                algo.name,
                role.name,
                run,
                url if user is None else with_user(url, user[0], read_password_file(user[1])),
                ident=i,
                device=device,
                checkpoint=checkpoint if role.checkpoints else None,
                nice=nice if role.nice else 0,
                snapshot=snapshot,
            )
            procs[name] = start_process(spec, run_dir / "logs" / f"{name}.log", name)
        console.print(
            f"[bold]qrl[/] {algo.name} on {cfg.env}: run {run!r}, "
            f"Redis {redact(url) if redis_url else 'embedded'}, "
            f"{len(procs)} processes, logs in {run_dir / 'logs'}; "
            + (
                "no target"
                if budget.target_return is None
                else f"target {budget.target_return} (confirmed on {budget.confirm_episodes} "
                "episodes)"
            )
        )
        next_eval = time.monotonic() + budget.eval_every
        interactive = console.is_terminal
        next_line = time.monotonic() + 5
        with (
            RunLog(run_dir, tracking=tracking, run=run, config=run_config) as runlog,
            Live(_table(progress, run), console=console, refresh_per_second=2, transient=False)
            if interactive
            else _Null() as live,
        ):
            while not stop():
                for msg in reader.read(block_ms=500):
                    progress.fold(msg)
                if on_tick is not None:
                    on_tick()
                now = time.monotonic()
                elapsed = now - progress.start
                if now >= next_eval:
                    try:
                        score = evaluator(client, keys)
                    except (ValueError, RuntimeError) as e:  # e.g. weights that do not fit
                        log.warning("evaluation failed: %s", e)
                        score = None
                    if score is not None:
                        progress.record_eval(score)
                        if budget.target_return is not None and score >= budget.target_return:
                            confirmed = confirm(evaluator, budget, score, console)
                            reached = confirmed is None or confirmed >= budget.target_return
                    eval_s = time.monotonic() - now  # evaluate (and confirm) <= ~20% of the time
                    next_eval = time.monotonic() + max(budget.eval_every, 4 * eval_s)
                runlog.write(progress)
                if interactive:
                    live.update(_table(progress, run))
                elif now >= next_line:
                    console.print(" ".join(f"{k}={v}" for k, v in progress.row().items()))
                    next_line = now + 5
                dead = [n for n, p in procs.items() if p.exitcode is not None]  # none may end
                if dead:
                    for name in dead:  # a crash's last line is its exception: say why here
                        why[name] = last = _last_line(run_dir / "logs" / f"{name}.log")
                        console.print(
                            Text.assemble((f"{name} failed", "red"), f": {last}" if last else "")
                        )
                    console.print(f"[red]see {run_dir / 'logs'}[/]")
                    failed = True
                    break
                if reached:
                    break
                if budget.max_time is not None and elapsed >= budget.max_time:
                    break
                if budget.max_steps is not None and progress.value(ENV_STEPS) >= budget.max_steps:
                    break
            # each role reports once more as it stops: a job that reached its target before a
            # role's first report still counts that role's work in its last row
            _shutdown(client, keys, procs, grace=15)
            with contextlib.suppress(redis.RedisError, RedisUnavailable):
                for msg in reader.read():
                    progress.fold(msg)
            runlog.write(progress, force=True)
    except KeyboardInterrupt:
        console.print("interrupted")
        failed = True
    except RedisUnavailable as e:  # stopped while Redis is away: end now (else: exit 3)
        if stop is None or not stop.local.is_set():
            raise
        console.print(f"interrupted; {e}")
        failed = True
    finally:
        _shutdown(client, keys, procs, grace=15)
        if server is not None:
            server.stop()
    row = progress.row()
    verdict = "reached" if reached else "did not reach"
    target = "no target" if budget.target_return is None else f"target {budget.target_return}"
    console.print(
        f"{verdict if budget.target_return is not None else 'ran with'} {target} in "
        f"{row[TIME.name]:.1f}s: "
        f"eval {row[EVAL_RETURN.name]}, "
        f"{row[ENV_STEPS.name]} env steps, {row[UPDATES.name]} updates; run dir {run_dir}"
    )
    if stop is not None and stop.local.is_set() and not reached:
        failed = True  # Ctrl-C / SIGTERM
    code = 0 if reached else 2 if failed else 0 if budget.target_return is None else 1
    result = {
        **row,
        "reached": reached,
        "target": budget.target_return,
        "confirm_episodes": budget.confirm_episodes,
        "confirm_return": confirmed,
        "exit_code": code,
        "failed": why,  # each role that failed: its log's last line
    }
    write_json(run_dir / "result.json", result)
    if reached and evaluator.last is not None and checkpoint.exists():
        # the learner kept training after the evaluation that reached the target: keep the
        # weights that reached it, not whatever came after
        w = evaluator.last
        replace_model(checkpoint, w.params, w.version, w.meta)
    return code


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *_: object) -> None:
        return None
