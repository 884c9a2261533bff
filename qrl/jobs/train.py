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

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from qrl.algos import Algorithm
from qrl.jobs.acl import process_users
from qrl.jobs.launch import RoleSpec, start_process
from qrl.jobs.one_process import refusal, seated
from qrl.rl.envspec import EnvSpec
from qrl.runtime.checkpoint import replace_model
from qrl.runtime.config import Config, with_budget
from qrl.runtime.control import StopFlag, clear_stop, request_stop
from qrl.runtime.files import write_json
from qrl.runtime.live import LiveConfig
from qrl.runtime.metrics import MetricsReader
from qrl.runtime.roles import ENV_STEPS, EVAL_RETURN, TIME, UPDATES
from qrl.runtime.runlog import Progress, RunLog
from qrl.runtime.runs import create_run
from qrl.runtime.tracking import Tracking
from qrl.runtime.turns import Seat
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


class OneProcessRefused(ValueError):
    """A run that ``--one-process`` cannot run (the message says what it runs)."""


@dataclass
class Budget:
    target_return: float | None = 475.0
    max_time: float | None = 90.0
    max_steps: int | None = None
    max_updates: int | None = None  # each role that counts updates (learners) stops at this
    eval_every: float = 0.5  # seconds; a short run's solve is seen within half a second
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

    def __init__(self, algo: Algorithm, cfg: Config, episodes: int, env: str | None = None) -> None:
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
        import torch

        from qrl.rl.evaluate import evaluate

        if self.spec is None:
            self.spec = EnvSpec.of(self.cfg.env)
        # a fresh network draws its initial parameters from torch's generator: the roles'
        # own in a one-process run, whose draws must not depend on when evaluations came
        with torch.random.fork_rng(devices=[]):
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
    client: redis.Redis | None, keys: RunKeys, procs: dict[str, BaseProcess | Seat], grace: float
) -> None:
    if client is not None:
        with contextlib.suppress(redis.RedisError, RedisUnavailable):  # roles stop anyway
            request_stop(client, keys)
    for p in procs.values():
        # this job's own processes hear it at once: SIGTERM stops a role as the request does
        # (its last report, its checkpoint), where its poll of the request takes up to 0.25 s
        if isinstance(p, BaseProcess) and p.exitcode is None:
            p.terminate()
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


@dataclass
class Launch:
    """How a job's roles start: ``device`` for those that use torch; the roles that declare
    ``nice`` (actors) run ``nice`` steps nicer than the rest (the learner first on a shared
    machine); ``snapshot``: the learner resumes from the snapshot in this file and saves its
    state there as it stops (population-based training's trials: :mod:`qrl.runtime.snapshot`);
    ``acl``: every process connects as a Redis ACL user of its own (passwords in
    ``run_dir/acl``), the job itself as the user of its URL; ``role_urls``: (role, number) ->
    the URL each process connects with instead (users made beforehand: a PBT trial's,
    :mod:`qrl.pbt.acl`); ``one_process``: the roles run as threads of this process that take
    turns with the job (:mod:`qrl.runtime.turns`), deterministic for a seed, their logs in
    the same files (``OneProcessRefused`` if the run cannot,
    :func:`qrl.jobs.one_process.refusal`)."""

    device: str = "auto"
    nice: int = 0
    snapshot: Path | None = None
    acl: bool = False
    role_urls: dict[tuple[str, int], str] | None = None
    one_process: bool = False


class TrainingJob:
    """One ``qrl train`` job on a Redis at ``url``: :meth:`start` its roles, :meth:`watch`
    them (progress, evaluations, the budget) until it ends, :meth:`stop` them, and
    :meth:`finish` (the summary, result.json, the checkpoint that reached the target)."""

    def __init__(
        self,
        algo: Algorithm,
        cfg: Config,
        budget: Budget,
        launch: Launch,
        *,
        run: str,
        run_dir: Path,
        console: Console,
        interrupted: threading.Event | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        if launch.one_process:
            no = (
                "--one-process runs every role as this process's user: no --acl"
                if launch.acl
                else None
            )
            if no := no or refusal(algo, cfg):
                raise OneProcessRefused(no)
        cfg = with_budget(cfg, budget.max_steps, budget.max_time)  # an annealing learner's
        self.algo, self.cfg, self.budget, self.launch = algo, cfg, budget, launch
        self.run, self.run_dir, self.console = run, run_dir, console
        self.interrupted, self.on_tick = interrupted, on_tick
        self.keys = RunKeys(run)
        self.checkpoint = run_dir / "checkpoint.pt"
        self.run_config = {"algo": algo.name, "run": run, "config": cfg.to_dict()}
        self.evaluator = Evaluator(algo, cfg, budget.eval_episodes, budget.eval_env)
        self.progress = Progress(algo.reports)
        self.client: redis.Redis | None = None
        self.stop_flag: StopFlag | None = None
        self.reader: MetricsReader | None = None
        self.procs: dict[str, BaseProcess | Seat] = {}
        self.limited: set[str] = set()  # the roles stopped by budget.max_updates
        self.seats = contextlib.ExitStack()  # a one-process run's seats and logs, closed last
        self.reached = self.failed = False
        self.why: dict[str, str] = {}  # a failed role: the last line of its log
        self.confirmed: float | None = None  # the last confirmation's mean return
        self.next_eval = 0.0

    def start(self, url: str, shown_url: str) -> None:
        """Write the run's config (to Redis and the run dir) and start every role."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        write_json(self.run_dir / "config.json", self.run_config)  # not through a planted link
        launch, keys = self.launch, self.keys
        start = self.seats.enter_context(seated()) if launch.one_process else start_process
        self.client = client = connect(url)
        create_run(client, keys, self.algo.name, self.cfg)
        clear_stop(client, keys)  # a rerun of a stopped run starts afresh
        # its stop polls also record each live config change in the run dir
        live = LiveConfig(client, keys, self.cfg, self.run_dir / "config_changes.jsonl")
        self.stop_flag = StopFlag(client, keys, live=live, local=self.interrupted)
        # from now, before any role starts: a rerun of a run (a PBT trial's next segment)
        # counts its own work, not what earlier jobs of the run reported
        self.reader = MetricsReader(client, keys, self.algo.reporters(self.cfg))
        users = {}
        if launch.acl:
            users = process_users(client, self.algo, keys, self.cfg, self.run_dir / "acl")
        urls = {p: with_user(url, u, read_password_file(path)) for p, (u, path) in users.items()}
        urls |= launch.role_urls or {}
        disconnect(client)  # forked roles inherit no open connection
        for role, i in self.algo.processes(self.cfg):
            name = f"{role.name}{i}" if role.count else role.name
            limit = self.budget.max_updates if role.limit == "updates" else None
            spec = RoleSpec(
                self.algo.name,
                role.name,
                self.run,
                urls.get((role.name, i), url),
                ident=i,
                device=launch.device,
                checkpoint=self.checkpoint if role.checkpoints else None,
                nice=launch.nice if role.nice else 0,
                snapshot=launch.snapshot,
                limit=limit,
            )
            self.procs[name] = start(spec, self.run_dir / "logs" / f"{name}.log", name)
            if limit is not None:
                self.limited.add(name)
        budget = self.budget
        self.console.print(
            f"[bold]qrl[/] {self.algo.name} on {self.cfg.env}: run {self.run!r}, "
            f"Redis {shown_url}, {len(self.procs)} "
            f"{'roles in one process' if launch.one_process else 'processes'}, "
            f"logs in {self.run_dir / 'logs'}; "
            + (
                "no target"
                if budget.target_return is None
                else f"target {budget.target_return} (confirmed on {budget.confirm_episodes} "
                "episodes)"
            )
        )

    def watch(self, tracking: Tracking | None) -> None:
        """Follow the run until its target is reached, its budget runs out, a role fails or
        it is stopped: progress into the run log and onto the console, evaluations when due."""
        assert self.stop_flag is not None and self.reader is not None
        self.next_eval = time.monotonic() + self.budget.eval_every
        # (one process: lines, no live table redrawn by a thread of its own over a debugger's)
        interactive = self.console.is_terminal and not self.launch.one_process
        next_line = time.monotonic() + 5
        progress = self.progress
        with (
            RunLog(self.run_dir, tracking=tracking, run=self.run, config=self.run_config) as runlog,
            Live(_table(progress, self.run), console=self.console, refresh_per_second=2)
            if interactive
            else _Null() as live,
        ):
            while not self.stop_flag():
                # no longer than until the next evaluation is due: a solve is seen when it is
                wait = min(0.5, self.next_eval - time.monotonic())
                for msg in self.reader.read(block_ms=max(int(wait * 1000), 1)):
                    progress.fold(msg)
                if self.on_tick is not None:
                    self.on_tick()
                now = time.monotonic()
                if now >= self.next_eval:
                    self.evaluate()
                runlog.write(progress)
                if interactive:
                    live.update(_table(progress, self.run))
                elif now >= next_line:
                    self.console.print(" ".join(f"{k}={v}" for k, v in progress.row().items()))
                    next_line = now + 5
                if self.ended() or self.reached or self.out_of_budget(now):
                    break
            # each role reports once more as it stops: a job that reached its target before a
            # role's first report still counts that role's work in its last row
            self.stop()
            with contextlib.suppress(redis.RedisError, RedisUnavailable):
                for msg in self.reader.read():
                    progress.fold(msg)
            runlog.write(progress, force=True)

    def evaluate(self) -> None:
        """Evaluate the weights published since the last evaluation, confirm a score that
        reaches the target; evaluations (and confirmations) take at most ~20% of the time."""
        t0 = time.monotonic()
        try:
            score = self.evaluator(self.client, self.keys)
        except (ValueError, RuntimeError) as e:  # e.g. weights that do not fit
            log.warning("evaluation failed: %s", e)
            score = None
        target = self.budget.target_return
        if score is not None:
            self.progress.record_eval(score)
            if target is not None and score >= target:
                self.confirmed = confirm(self.evaluator, self.budget, score, self.console)
                self.reached = self.confirmed is None or self.confirmed >= target
        eval_s = time.monotonic() - t0
        self.next_eval = time.monotonic() + max(self.budget.eval_every, 4 * eval_s)

    def ended(self) -> bool:
        """Whether a role ended: one that failed (said on the console) or one that reached
        ``budget.max_updates``; no other role may end."""
        ended = {n: p.exitcode for n, p in self.procs.items() if p.exitcode is not None}
        done = [n for n, code in ended.items() if code == 0 and n in self.limited]
        dead = [n for n in ended if n not in done]
        for name in dead:  # a crash's last line is its exception: say why here
            self.why[name] = last = _last_line(self.run_dir / "logs" / f"{name}.log")
            self.console.print(
                Text.assemble((f"{name} failed", "red"), f": {last}" if last else "")
            )
        if dead:
            self.console.print(f"[red]see {self.run_dir / 'logs'}[/]")
            self.failed = True
        return bool(dead or done)

    def out_of_budget(self, now: float) -> bool:
        budget = self.budget
        if budget.max_time is not None and now - self.progress.start >= budget.max_time:
            return True
        return budget.max_steps is not None and self.progress.value(ENV_STEPS) >= budget.max_steps

    def stop(self) -> None:
        """Stop every role (again: harmless), and close a one-process run's seats."""
        _shutdown(self.client, self.keys, self.procs, grace=15)
        self.seats.close()

    def finish(self) -> int:
        """Say how it went, write result.json, keep the weights that reached the target in
        the checkpoint; the exit code (see :func:`run_training`)."""
        row, budget = self.progress.row(), self.budget
        verdict = "reached" if self.reached else "did not reach"
        target = "no target" if budget.target_return is None else f"target {budget.target_return}"
        self.console.print(
            f"{verdict if budget.target_return is not None else 'ran with'} {target} in "
            f"{row[TIME.name]:.1f}s: "
            f"eval {row[EVAL_RETURN.name]}, "
            f"{row[ENV_STEPS.name]} env steps, {row[UPDATES.name]} updates; run dir {self.run_dir}"
        )
        if self.stop_flag is not None and self.stop_flag.local.is_set() and not self.reached:
            self.failed = True  # Ctrl-C / SIGTERM
        code = self.exit_code()
        result = {
            **row,
            "reached": self.reached,
            "target": budget.target_return,
            "confirm_episodes": budget.confirm_episodes,
            "confirm_return": self.confirmed,
            "exit_code": code,
            "failed": self.why,  # each role that failed: its log's last line
        }
        write_json(self.run_dir / "result.json", result)
        if self.reached and self.evaluator.last is not None and self.checkpoint.exists():
            # the learner kept training after the evaluation that reached the target: keep the
            # weights that reached it, not whatever came after
            w = self.evaluator.last
            replace_model(self.checkpoint, w.params, w.version, w.meta)
        return code

    def exit_code(self) -> int:
        if self.reached:
            return 0
        if self.failed:
            return 2
        return 0 if self.budget.target_return is None else 1  # no target: the budget ran


def run_training(
    algo: Algorithm,
    cfg: Config,
    budget: Budget,
    *,
    redis_url: str | None,
    run: str,
    run_dir: Path,
    device: str = "auto",
    console: Console | None = None,
    tracking: Tracking | None = None,
    nice: int = 0,
    snapshot: Path | None = None,
    interrupted: threading.Event | None = None,
    on_tick: Callable[[], None] | None = None,
    acl: bool = False,
    role_urls: dict[tuple[str, int], str] | None = None,
    one_process: bool = False,
) -> int:
    """Run a whole job (:class:`TrainingJob`) on ``redis_url``, or on an embedded Redis of
    its own; returns the exit code: 0 if the target return was reached (with no target: if
    the whole budget ran), 1 if the budget ran out first, 2 if a role failed or the job was
    interrupted. A job that reached its target leaves the weights that reached it in its
    checkpoint. ``interrupted``: the event SIGINT/SIGTERM set (the caller's, to see them
    too); ``on_tick``: called about every half second while the job runs (a PBT slot's
    lease); the rest says how the roles start (:class:`Launch`). A role that reached
    ``budget.max_updates`` ends the job."""
    console = console or Console(stderr=True)
    launch = Launch(device, nice, snapshot, acl, role_urls, one_process)
    job = TrainingJob(
        algo,
        cfg,
        budget,
        launch,
        run=run,
        run_dir=run_dir,
        console=console,
        interrupted=interrupted,
        on_tick=on_tick,
    )
    # the embedded Redis has a password of its own: no other user of the machine gets in,
    # and a QRL_REDIS_PASSWORD meant for another Redis does not apply to it
    server = None if redis_url else EmbeddedRedis(password=secrets.token_urlsafe(16)).start()
    url = redis_url or server.url  # type: ignore[union-attr]
    try:
        job.start(url, redact(url) if redis_url else "embedded")
        job.watch(tracking)
    except KeyboardInterrupt:
        console.print("interrupted")
        job.failed = True
    except RedisUnavailable as e:  # stopped while Redis is away: end now (else: exit 3)
        if job.stop_flag is None or not job.stop_flag.local.is_set():
            raise
        console.print(f"interrupted; {e}")
        job.failed = True
    finally:
        job.stop()
        if server is not None:
            server.stop()
    return job.finish()


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *_: object) -> None:
        return None
