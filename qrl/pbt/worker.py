"""A PBT worker slot (``qrl pbt worker``): takes a trial from the population's leases; if the
trial ranks low on the scoreboard, exploits and explores first (it takes a top trial's state
as that trial's last segment left it: the freshest copy there is, where copying as the low
trial's own segment ended would leave the copy a segment behind by the time it runs again,
with more trials than slots); trains it for one segment (``ready_s`` seconds, or
``ready_steps`` env steps within them, as a ``qrl train`` job on the population's Redis
whose learner resumes from the trial's snapshot and leaves its state for the slot to store as
the trial's), posts its score to the scoreboard, and gives the trial back: more trials than
slots take turns, and a worker on any machine can take any trial. The trial's records in
Redis (score, lineage, claim, snapshot) are the slot's to write: with ``--acl`` each process of
the segment runs as a user of its own that may not (:mod:`qrl.pbt.acl`).

A worker that dies holds its trial until the lease runs out (``ready_s + lease_s``); its role
processes are stopped as their parent dies, the learner saving the trial's state to the
checkpoint in the slot's run dir (a later segment there resumes from it), and the next worker
to take the trial goes on from the snapshot its last whole segment stored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from qrl.algos import ALGOS
from qrl.pbt.acl import role_urls
from qrl.pbt.config import PBTConfig
from qrl.pbt.exploit import UNREADABLE, choose, exploit
from qrl.pbt.population import Population
from qrl.rl.envs import check_env_id
from qrl.runtime.control import StopFlag
from qrl.runtime.roles import EPISODIC_RETURN, EVAL_RETURN
from qrl.runtime.runs import load_run_config
from qrl.runtime.snapshot import SnapshotStore
from qrl.wire.connection import RedisUnavailable, connect, disconnect
from qrl.wire.faults import warn_once
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def segment(
    client: redis.Redis,
    url: str,
    pcfg: PBTConfig,
    trial: str,
    run_dir: Path,
    device: str,
    interrupted: threading.Event,
    renew: Callable[[], None] | None = None,
    acl: bool = False,
) -> dict[str, Any]:
    """Train ``trial`` for one segment (``renew`` called about every half second); ``qrl
    train``'s result (result.json). ``acl``: ``url`` is the trial's user's, and each process
    of the segment runs as its own user (:func:`qrl.pbt.acl.role_urls`)."""
    from qrl.jobs.train import Budget, run_training  # torch

    algo = ALGOS[pcfg.algo]
    keys = RunKeys(trial)
    cfg = load_run_config(client, keys, algo.name, algo.config)
    # a segment of ready_steps has no known length: evaluate as often as the job allows
    # (it keeps evaluation under a fifth of the time), so a short one is evaluated too
    every = max(1.0, pcfg.ready_s / 4) if pcfg.ready_steps is None else 1.0
    budget = Budget(
        target_return=pcfg.target_return,
        max_time=pcfg.ready_s,
        max_steps=pcfg.ready_steps,
        eval_every=every,
        eval_episodes=pcfg.eval_episodes,
        confirm_episodes=pcfg.confirm_episodes,
    )
    # the learner resumes from this file and leaves its state there as it stops: only this
    # slot's user writes the trial's snapshot in Redis, no process of the segment may
    store, snapshot = SnapshotStore(client, keys), run_dir / "snapshot"
    store.to_file(snapshot)
    urls = role_urls(url, trial, algo, cfg) if acl else None
    disconnect(client)  # the segment's roles are forked: they inherit no connection
    with open(os.devnull, "w") as quiet:  # its progress: the trial's run dir and logs
        run_training(
            algo,
            cfg,
            budget,
            redis_url=url,
            run=trial,
            run_dir=run_dir,
            device=device,
            console=Console(file=quiet),
            snapshot=snapshot,
            interrupted=interrupted,
            on_tick=renew,
            role_urls=urls,
        )
    try:
        store.from_file(snapshot)
    except redis.ResponseError as e:  # e.g. BUSY: the learner's checkpoint here still has it
        warn_once(str(e), "%s: its state is not stored (%s)", trial, e, logger=log)
    return json.loads((run_dir / "result.json").read_text())


class Renewal:
    """Renews a slot's lease every few seconds while its segment runs (a segment that runs
    long, e.g. through a slow confirmation, keeps its trial); warns once if it was lost."""

    def __init__(self, pop: Population, trial: str, me: str, lease_s: float) -> None:
        self.pop, self.trial, self.me, self.lease_s = pop, trial, me, lease_s
        self.next, self.lost = time.monotonic() + 5.0, False

    def __call__(self) -> None:
        if time.monotonic() < self.next or self.lost:
            return
        self.next = time.monotonic() + 5.0
        try:
            self.lost = not self.pop.renew(self.trial, self.me, self.lease_s)
        except redis.RedisError as e:
            log.warning("could not renew the lease of %s: %s", self.trial, e)
        if self.lost:
            log.warning("%s lost its lease of %s (another worker took it)", self.me, self.trial)


def slot(
    url: str,
    name: str,
    run_root: Path,
    device: str = "auto",
    trial_urls: dict[str, str] | None = None,
) -> int:
    """Run trials of population ``name`` one segment at a time until it is solved or this
    process is asked to stop (SIGINT/SIGTERM); the number of segments run. ``trial_urls``:
    the trials this slot may run, each with the URL that runs it (as its worker's ACL user,
    :mod:`qrl.pbt.acl`); default every trial, by ``url``."""
    client = connect(url, wait=30)
    pop = Population(client, name)
    pcfg = pop.config()  # validated: an algorithm PBT runs, sane settings
    check_env_id(pcfg.env)  # data: it may name no module to import
    urls = trial_urls or dict.fromkeys(pcfg.trials(), url)
    pops = {t: pop if u == url else Population(connect(u, wait=30), name) for t, u in urls.items()}
    me, rng, done = worker_id(), random.Random(), 0
    stop = StopFlag(client, RunKeys(name))  # `qrl run stop NAME` stops the population's workers
    while not stop() and pop.solved() is None:
        try:
            trial = pop.claim(me, pcfg.ready_s + pcfg.lease_s, list(pops), via=pops)
        except redis.ResponseError as e:  # e.g. BUSY, or a user without its trial's keys
            warn_once(str(e), "population %s: cannot take a lease (%s)", name, e, logger=log)
            trial = None
        if trial is None:
            time.sleep(1.0)
            continue
        log.info("%s: segment of %s", me, trial)
        mine = pops[trial]
        try:
            take_better(mine, pcfg, trial, rng)
            renew = Renewal(mine, trial, me, pcfg.ready_s + pcfg.lease_s)
            for other in pops.values():  # the segment's roles are forked: no connection
                disconnect(other.client)
            try:
                result = segment(
                    mine.client,
                    urls[trial],
                    pcfg,
                    trial,
                    run_root / trial,
                    device,
                    stop.local,
                    renew,
                    acl=trial_urls is not None,
                )
            except UNREADABLE as e:  # its run's config, as someone rewrote it: not this slot's end
                warn_once(f"{trial}: {e}", "%s: cannot train %s: %s", me, trial, e, logger=log)
                time.sleep(1.0)
                continue
            if stop.local.is_set():  # cut short: no score
                break
            done += 1
            for role, why in (result.get("failed") or {}).items():  # e.g. a snapshot too big
                log.error("%s: a segment of %s ended: %s failed: %s", me, trial, role, why)
            if renew.lost:  # another worker holds the trial now: it is not ours to change
                continue
            finish(mine, pcfg, trial, result)
        finally:
            with contextlib.suppress(redis.RedisError, RedisUnavailable):  # else it runs out
                mine.release(trial, me)
    return done


def take_better(
    pop: Population, pcfg: PBTConfig, trial: str, rng: random.Random
) -> dict[str, Any] | None:
    """Before a segment: if ``trial`` ranks low, it takes a top trial's state and explored
    hyperparameters (the lineage event), else None."""
    if not pcfg.exploit:
        return None
    scores = pop.scores(pcfg.trials())
    if pcfg.burn_in:  # only trials past their burn-in rank, this one included
        trained = pop.segments(pcfg.trials())
        scores = {t: s for t, s in scores.items() if trained[t] >= pcfg.burn_in}
    source = choose(trial, scores, pcfg.quantile, rng)
    if source is None:
        return None
    try:
        return exploit(pop.client, pop, pcfg, trial, source, rng, scores)
    except UNREADABLE as e:  # the source's worker wrote its keys: no copy this time
        warn_once(f"{source}: {e}", "%s cannot copy %s: %s", trial, source, e, logger=log)
        return None


def finish(pop: Population, pcfg: PBTConfig, trial: str, result: dict[str, Any]) -> None:
    """After a segment: the claim that it reached the target (the controller confirms it), or
    the score (none if no episode ended, or no evaluation). A Redis that refuses them (BUSY
    with a script, NOPERM) loses this segment's record with one warning; the slot goes on."""
    try:
        pop.trained(trial)
        if result.get("reached"):
            reached = float(result.get("confirm_return") or result[EVAL_RETURN.name])
            pop.report_reached(trial, reached)
            return
        score = result.get((EPISODIC_RETURN if pcfg.score == "train" else EVAL_RETURN).name)
        if isinstance(score, (int, float)) and math.isfinite(score):
            pop.post(trial, float(score))
    except redis.ResponseError as e:
        warn_once(str(e), "%s: its segment's record is lost (%s)", trial, e, logger=log)
