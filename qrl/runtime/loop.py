"""One role loop for every process of a run.

A role (an actor, a learner, a replay filler, an ES master or worker) supplies its work one
step at a time and the values of its reports; :func:`run_role` owns everything around that:
the stop check, live config changes handed to the role between steps, the rate arithmetic,
the once-a-second metrics report that also refreshes the process's heartbeat, the
checkpoint timer, leaving ``qrl status`` on a clean stop, the stop summary in the log,
riding out a step Redis refused (NOPERM: retried with backoff, one warning a minute),
failure propagation (a role whose data thread failed ends the process with an error, not
silently), and in a one-process run the next role's turn after each step
(:mod:`qrl.runtime.turns`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from qrl.runtime.config import Config
from qrl.runtime.live import LiveConfig
from qrl.runtime.metrics import report
from qrl.runtime.status import leave
from qrl.wire import clock
from qrl.wire.faults import refused, warn_every
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)

StopCheck = Callable[[], bool]


class RoleFailed(RuntimeError):
    """A role could not go on (e.g. a data thread died); the message says what failed."""


class Role:
    """The work of one process. Subclasses set ``name`` and ``counter`` and implement
    :meth:`step`; the other methods are optional."""

    name = "role"  # in metrics and heartbeats: actor, learner, replay, worker, master
    counter = "steps"  # the progress counter in :meth:`metrics`, reported with its rate
    failed: str | None = None  # set by :meth:`fail`

    def start(self, should_stop: StopCheck) -> bool:
        """Prepare (wait for weights, start threads); False if stopped before starting."""
        return True

    def step(self, should_stop: StopCheck) -> bool:
        """One unit of work (a vector step, an update, a batch of entries); False when the
        role cannot go on (stopped while waiting, or failed)."""
        raise NotImplementedError

    def metrics(self) -> dict[str, Any]:
        """The values of one report (numbers or lists of numbers), ``counter`` included;
        per-report accumulators (episode returns, losses) are drained."""
        return {}

    def save(self) -> None:
        """Write a checkpoint (roles with state of their own)."""

    def reconfigure(self, cfg: Config) -> None:
        """Run on with ``cfg``, the config with live fields changed (:mod:`qrl.runtime.live`),
        called between two steps. Here ``self.cfg`` is swapped: enough for a field the role
        reads from it as it goes; a role that derived state from one (an optimizer's
        learning rate, an actor's epsilons) sets that state again."""
        self.cfg = cfg

    def close(self, should_stop: StopCheck) -> None:
        """Finish: push what is left, stop threads, publish the last weights."""

    def fail(self, what: str) -> None:
        """A part of the role cannot go on: the loop ends and the process exits non-zero."""
        log.error("%s failed", what, exc_info=sys.exc_info()[0] is not None)
        self.failed = f"{what} failed"

    @property
    def count(self) -> int:
        """The current value of the ``counter`` attribute."""
        return int(getattr(self, self.counter))


def run_role(
    role: Role,
    client: redis.Redis,
    keys: RunKeys,
    ident: int,
    should_stop: StopCheck,
    *,
    limit: int | None = None,
    report_every: float = 1.0,
    checkpoint_every: float | None = None,
    first_checkpoint: float = 10.0,
    live: LiveConfig | None = None,
) -> int:
    """Run ``role`` until ``should_stop()``, until its counter advanced by ``limit``, or
    until it cannot go on; returns how far its counter advanced. A config change ``live``
    took in (polled by ``should_stop``) goes to :meth:`Role.reconfigure` before the next
    step, and a report with its version goes at once. The first checkpoint is
    written after ``first_checkpoint`` seconds (so a run has one to evaluate early), then
    every ``checkpoint_every``, and one at the end. Raises :class:`RoleFailed` if the role
    failed."""
    if not role.start(should_stop):
        log.info("%s %d stopped before it started", role.name, ident)
        return 0
    start = role.count  # after start(): a resumed learner may have moved on to Redis's version
    log.info("%s %d started at %d %s", role.name, ident, start, role.counter)
    reason = "stopped"
    now = time.monotonic()
    last = (now, start)
    next_report = now + report_every
    next_ckpt = None if checkpoint_every is None else now + min(first_checkpoint, checkpoint_every)
    pause = 0.1  # after a refused step, doubling up to 5 s while they stay refused
    turn = clock.current().turn  # in a one-process run: the next role's turn after each step
    try:
        while True:
            if should_stop():
                break
            if live is not None and (cfg := live.take()) is not None:
                role.reconfigure(cfg)
                now = time.monotonic()  # the change shows in a report at once
                last = _report(role, client, keys, ident, last, now, live)
                next_report = now + report_every
            if limit is not None and role.count - start >= limit:
                reason = f"reached its limit of {limit} {role.counter}"
                break
            try:
                if not role.step(should_stop):
                    break
                turn()
                now = time.monotonic()
                if now >= next_report:
                    last = _report(role, client, keys, ident, last, now, live)
                    next_report = now + report_every
                pause = 0.1
            except redis.ResponseError as e:
                if not refused(e):
                    raise
                pause = _refused(role, ident, e, pause)
                now = time.monotonic()  # the checkpoint timer still runs
            if next_ckpt is not None and now >= next_ckpt:
                role.save()
                log.info("%s %d: checkpoint at %d %s", role.name, ident, role.count, role.counter)
                next_ckpt = now + checkpoint_every  # type: ignore[operator]
    finally:
        try:
            role.save()  # local state first: it must not depend on Redis being there
        finally:
            role.close(should_stop)
    if role.failed:
        reason = role.failed
    _report(role, client, keys, ident, last, time.monotonic(), live)
    if not role.failed:
        with contextlib.suppress(redis.RedisError):
            leave(client, keys, role.name, ident)
    done = role.count - start
    log.info("%s %d %s after %d %s", role.name, ident, reason, done, role.counter)
    if role.failed:
        raise RoleFailed(f"{role.name} stopped: {role.failed}")
    return done


def _refused(role: Role, ident: int, error: redis.ResponseError, pause: float) -> float:
    """A step (or report) Redis refused (NOPERM): the role's ACL user lacks a command or
    key. It may be a rule that lacks what the role needs (then no retry helps) or a key
    another role must repair first: either way an outage to wait out, not an exit, and
    seen (one warning a minute, :func:`qrl.wire.faults.warn_every`). Sleeps ``pause``;
    returns the next one."""
    warn_every(
        f"refused:{role.name}.{ident}",
        "%s %d: Redis refused a command (NOPERM %s): this role's ACL user lacks it (check its "
        "rule: docs/security.md); retrying",
        role.name,
        ident,
        error,
        logger=log,
    )
    clock.sleep(pause)
    return min(pause * 2, 5.0)


def _report(
    role: Role,
    client: redis.Redis,
    keys: RunKeys,
    ident: int,
    last: tuple[float, int],
    now: float,
    live: LiveConfig | None,
) -> tuple[float, int]:
    """Send one report with the counter's rate since ``last`` and the live config version
    the role runs with; returns the new ``last``."""
    t0, c0 = last
    values = role.metrics()
    count = role.count
    values[f"{role.counter}_per_s"] = (count - c0) / max(now - t0, 1e-9)
    if live is not None:
        values["config_version"] = live.applied
    report(client, keys, role.name, ident, **values)
    return now, count
