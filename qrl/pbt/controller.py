"""``qrl pbt ALGO``: a whole population in one command. It stores the population in Redis
(an embedded one unless given a URL), makes each trial's run with hyperparameters drawn from
the explored ranges, starts ``slots`` worker slots on this machine (workers elsewhere may
join with ``qrl pbt worker``), follows the scoreboard and the lineage, and stops when a trial
is confirmed at the target or the time runs out. A worker only claims that its trial reached
the target: the controller evaluates the trial itself (:class:`Confirmer`) before it says so.

The run dir holds ``lineage.jsonl`` (every exploit/explore event), ``scores.csv`` (each
trial's score and explored values over time: what ``qrl plot`` draws), ``result.json`` and a
directory per trial (its segments' logs, metrics and run files).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from qrl.algos import ALGOS
from qrl.jobs.launch import process_context, setup_logging
from qrl.jobs.train import Budget, Evaluator, confirm
from qrl.pbt.acl import CONTROLLER, as_user, create_users, delete_population_users
from qrl.pbt.config import PBTConfig
from qrl.pbt.exploit import UNREADABLE, current, initial_config
from qrl.pbt.population import Population
from qrl.runtime.control import clear_stop, on_stop_signals, request_stop
from qrl.runtime.files import open_appending, write_json
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis, die_with_parent
from qrl.wire.connection import RedisUnavailable, connect, disconnect, redact
from qrl.wire.faults import warn_once
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)


def _slot_main(
    url: str,
    name: str,
    run_root: Path,
    device: str,
    log_path: Path,
    trial_urls: dict[str, str] | None,
) -> None:
    from qrl.pbt.worker import slot

    die_with_parent()
    fd = open_appending(log_path, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    setup_logging(logging.INFO)
    try:
        slot(url, name, run_root, device, trial_urls)
    except redis.AuthenticationError:  # its users were deleted: the population ended
        log.info("population %s ended: its ACL users are gone", name)


def start_slots(
    url: str,
    name: str,
    run_root: Path,
    slots: int,
    device: str,
    trial_urls: dict[str, str] | None = None,
) -> list[Any]:
    """``slots`` worker slot processes on this machine, logging to ``run_root/logs``
    (``trial_urls``: see :func:`qrl.pbt.worker.slot`)."""
    (run_root / "logs").mkdir(parents=True, exist_ok=True)
    ctx = process_context()
    procs = []
    for s in range(slots):
        log_path = run_root / "logs" / f"slot{s}.log"
        args = (url, name, run_root, device, log_path, trial_urls)
        p = ctx.Process(target=_slot_main, args=args)
        p.start()
        procs.append(p)
    return procs


def stop_slots(procs: list[Any]) -> None:
    """Stop slot processes in order: each stops its segment's roles as SIGTERM asks (the
    learner saving its trial's state); one still there after 60 s is killed."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(60)
        if p.exitcode is None:
            p.kill()


def work(
    url: str,
    name: str,
    run_root: Path,
    slots: int,
    device: str,
    trial_urls: dict[str, str] | None = None,
) -> int:
    """``qrl pbt worker``: ``slots`` slots until each ends (the population solved, or ``qrl
    run stop``) or SIGINT/SIGTERM stops them; 0 if every slot ended cleanly. (The slots are
    this process's children: a signal to it alone must reach them, or it would wait on them
    for ever as it exits.)"""
    interrupted = threading.Event()
    on_stop_signals(interrupted.set)
    procs = start_slots(url, name, run_root, slots, device, trial_urls)
    try:
        while not interrupted.is_set() and any(p.exitcode is None for p in procs):
            interrupted.wait(1.0)
    finally:
        stop_slots(procs)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def setup(client: redis.Redis, pcfg: PBTConfig) -> Population:
    """The population and its trials' runs in Redis (those there already are kept)."""
    pop = Population(client, pcfg.name)
    pop.create(pcfg)
    algo = ALGOS[pcfg.algo]
    for i, trial in enumerate(pcfg.trials()):
        create_run(client, RunKeys(trial), algo.name, initial_config(pcfg, i))
    clear_stop(client, pop.keys)
    return pop


class Confirmer:
    """The controller's own check of a worker's claim that its trial reached the target: the
    trial's newest published weights, played with the config the population gave the trial
    (nothing a worker wrote) on ``eval_episodes`` episodes and, if they reach the target, on
    ``confirm_episodes`` fresh ones (``qrl train``'s confirmation), their seeds drawn here so
    that no worker knows them in advance. A claim is looked at once, each trial's at most
    once per ``ready_s`` (an honest worker claims once a segment)."""

    def __init__(self, pcfg: PBTConfig, console: Console) -> None:
        self.pcfg, self.console = pcfg, console
        self.seen: dict[str, bytes] = {}  # each trial's claim last looked at
        self.next: dict[str, float] = {}  # when each trial's claim may be looked at again

    def __call__(self, client: redis.Redis, pop: Population) -> dict[str, Any] | None:
        """The solve (trial, confirmed return, time), if a new claim is confirmed."""
        trials = self.pcfg.trials()
        for trial, claim in pop.reports(trials).items():
            if claim == self.seen.get(trial) or time.monotonic() < self.next.get(trial, 0.0):
                continue
            self.seen[trial], self.next[trial] = claim, time.monotonic() + self.pcfg.ready_s
            mean = self.evaluate(client, trials.index(trial))
            if mean is not None:
                return {"trial": trial, "return": mean, "time": time.time()}
        return None

    def evaluate(self, client: redis.Redis, index: int) -> float | None:
        """Trial ``index``'s confirmed mean return, or None if it did not reach the target."""
        pcfg, trial = self.pcfg, self.pcfg.trials()[index]
        target = pcfg.target_return
        cfg = initial_config(pcfg, index).model_copy(update={"seed": secrets.randbelow(2**20)})
        evaluator = Evaluator(ALGOS[pcfg.algo], cfg, pcfg.eval_episodes)
        try:
            score = evaluator(client, RunKeys(trial))
        except (ValueError, RuntimeError, redis.ResponseError) as e:  # weights that do not fit
            log.warning("%s claims the target; its weights cannot be evaluated: %s", trial, e)
            return None
        if score is None or target is None or score < target:
            what = "no weights" if score is None else f"{score:.1f}"
            self.console.print(f"{trial} claims the target; its weights: {what}, not confirmed")
            return None
        budget = Budget(target_return=target, confirm_episodes=pcfg.confirm_episodes)
        confirmed = confirm(evaluator, budget, score, self.console)
        mean = score if confirmed is None else confirmed
        return mean if mean >= target else None


class Follower:
    """Appends the lineage events seen since the last call to the run dir, and each scored
    trial's score and explored values when they changed (looked at every ``every`` seconds)."""

    def __init__(self, pcfg: PBTConfig, run_root: Path, every: float = 5.0) -> None:
        self.pcfg, self.root, self.events, self.every = pcfg, run_root, 0, every
        self.read: dict[str, int] = {}  # each trial's last lineage event read
        self.last: dict[str, float] = {}  # when each trial was last looked at
        self.written: dict[str, list[Any]] = {}  # each trial's last row: its score and values
        self.fields = [e.field for e in pcfg.explore]
        self.start = time.time()

    def __call__(self, client: redis.Redis, pop: Population) -> dict[str, float]:
        self.read, events = pop.lineage_after(self.read, self.pcfg.trials())
        with open(self.root / "lineage.jsonl", "a") as f:
            for e in events:
                f.write(json.dumps(e) + "\n")
        self.events += len(events)
        scores = pop.scores(self.pcfg.trials())
        path = self.root / "scores.csv"
        new = not path.exists()
        with open(path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["time", "trial", "score", *self.fields])
            for trial, score in scores.items():
                if time.time() < self.last.get(trial, 0.0) + self.every:
                    continue
                self.last[trial] = time.time()
                try:
                    cfg = current(client, self.pcfg, trial)
                    row = [score, *(getattr(cfg, name) for name in self.fields)]
                except UNREADABLE as e:  # its worker's user rewrote its config: values unknown
                    warn_once(
                        f"{trial}: {e}", "%s: its config is unreadable (%s)", trial, e, logger=log
                    )
                    row = [score, *([None] * len(self.fields))]
                if row != self.written.get(trial):  # a new score or new values: a point
                    self.written[trial] = row
                    w.writerow([f"{time.time() - self.start:.1f}", trial, *row])
        return scores


def run_population(
    pcfg: PBTConfig,
    *,
    redis_url: str | None,
    slots: int,
    run_root: Path,
    max_time: float | None,
    device: str = "auto",
    console: Console | None = None,
    acl: Path | None = None,
) -> int:
    """Run population ``pcfg``; exit code 0 if a trial was confirmed at the target, 1 if the
    time ran out first, 2 if every slot failed or it was interrupted. ``acl``: make the
    population's ACL users, passwords in that folder (:mod:`qrl.pbt.acl`), run the controller,
    each trial's slot and each process of its segments as their own users, and delete the
    users as the population ends (whichever way: a worker elsewhere loses its access)."""
    console = console or Console(stderr=True)
    run_root.mkdir(parents=True, exist_ok=True)
    write_json(run_root / "pbt.json", json.loads(pcfg.model_dump_json()))
    server = None if redis_url else EmbeddedRedis(password=secrets.token_urlsafe(16)).start()
    url = redis_url or server.url  # type: ignore[union-attr]
    procs: list[Any] = []
    client, pop, solved, code, segments = None, None, None, 1, {}
    start = time.monotonic()
    interrupted = threading.Event()  # SIGINT/SIGTERM: stop the slots in order, then Redis
    on_stop_signals(interrupted.set)
    try:
        client = connect(url)
        pop = setup(client, pcfg)
        trial_urls = None
        if acl is not None:  # from now on as the controller's user; each trial as its own
            users = create_users(client, pcfg, acl)
            trial_urls = {t: as_user(url, *users[t]) for t in pcfg.trials()}
            disconnect(client)
            client = connect(as_user(url, *users[CONTROLLER]))
            pop = Population(client, pcfg.name)
        disconnect(client)  # the slots are forked: they inherit no connection
        first = next(iter(trial_urls.values())) if trial_urls else url
        procs = start_slots(first, pcfg.name, run_root, slots, device, trial_urls)
        where = redact(url) if redis_url else "embedded"
        console.print(
            f"[bold]qrl pbt[/] {pcfg.algo} on {pcfg.env}: population {pcfg.name!r} of "
            f"{pcfg.population}, {slots} slots here, Redis {where}; logs in {run_root / 'logs'}"
        )
        if acl is not None:
            console.print(
                f"as ACL users {pcfg.name}.controller and {pcfg.name}-tI.worker per trial; "
                f"a worker elsewhere: `qrl pbt worker {pcfg.name} --acl DIR` with its trials' "
                f"password files from {acl}",
                markup=False,
            )
        follow, confirmer, next_line = Follower(pcfg, run_root), Confirmer(pcfg, console), 0.0
        while True:
            time.sleep(1.0)
            scores = follow(client, pop)
            solved = confirmer(client, pop)
            elapsed = time.monotonic() - start
            if time.monotonic() >= next_line:
                best = max(scores.values()) if scores else math.nan
                console.print(
                    f"{elapsed:6.0f}s best {best:.1f}, {len(scores)} scored, "
                    f"{follow.events} exploits"
                )
                next_line = time.monotonic() + 10
            if interrupted.is_set():
                code = 2
                break
            if solved is not None:  # its own evaluation's: what workers write is not read back
                console.print(f"{solved['trial']} confirmed at {solved['return']:.1f}")
                with contextlib.suppress(redis.RedisError, RedisUnavailable):  # stop does too
                    pop.solve(solved["trial"], solved["return"])  # the workers stop
                code = 0
                break
            if procs and all(p.exitcode is not None for p in procs):
                console.print(f"[red]every slot ended; see {run_root / 'logs'}[/]")
                code = 2
                break
            if max_time is not None and elapsed >= max_time:
                console.print(f"no trial reached {pcfg.target_return} in {max_time:g}s")
                break
    except KeyboardInterrupt:
        code = 2
    except RedisUnavailable as e:  # stopped while Redis is away: end now (else: exit 3)
        if not interrupted.is_set():
            raise
        console.print(f"interrupted; {e}")
        code = 2
    finally:
        if client is not None:
            with contextlib.suppress(redis.RedisError, RedisUnavailable):  # slots stop anyway
                request_stop(client, RunKeys(pcfg.name))
        stop_slots(procs)
        if pop is not None:  # each trial's segments trained, for the record
            with contextlib.suppress(redis.RedisError, RedisUnavailable):
                segments = pop.segments(pcfg.trials())
        if acl is not None:  # the slots here have stopped: the users go with the population
            with contextlib.suppress(redis.RedisError, RedisUnavailable):
                admin = connect(url)
                delete_population_users(admin, pcfg)
                disconnect(admin)
        if server is not None:
            server.stop()
    elapsed = time.monotonic() - start
    result = {"solved": solved, "elapsed": elapsed, "exit_code": code, "segments": segments}
    write_json(run_root / "result.json", result)
    return code
