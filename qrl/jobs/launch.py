"""Starting a role: one function, :func:`run_role`, whatever starts it (``qrl actor apex``
and the other role commands, the processes of ``qrl train``, the compose services, which
run those commands).

A :class:`RoleSpec` says which role of which run; :func:`run_role` connects, reads the
run's config from Redis (all a joining process needs is the URL and the run name), takes a
process number, asks the algorithm's builder to make the role and runs it in the one role
loop (:func:`qrl.runtime.loop.run_role`), giving it what its declaration
(:class:`qrl.runtime.algorithm.RoleDef`) asks for: a checkpoint, the run dir's metrics.
:func:`start_process` runs a spec in a child process.

Child processes are forked while the parent has no thread, no torch op run and no open
Redis connection, so they inherit torch's imports and nothing live; a parent with threads
gets ``forkserver`` instead (:func:`process_context`; docs/benchmarks.md, "Start method of
role processes", has the start-up cost of fork, forkserver and spawn).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Literal

import redis

from qrl.algos import ALGOS
from qrl.rl.envs import allow_env_modules, allowed_env_modules, check_env_id
from qrl.rl.envspec import EnvSpec
from qrl.runtime import loop
from qrl.runtime.algorithm import RoleContext
from qrl.runtime.config import Config
from qrl.runtime.control import StopFlag, on_stop_signals
from qrl.runtime.files import open_appending
from qrl.runtime.ids import claim_id, hold_id, user_ident
from qrl.runtime.live import LiveConfig
from qrl.runtime.loop import RoleFailed
from qrl.runtime.runs import RunNotFound, load_run, load_run_config
from qrl.runtime.tracking import Tracking
from qrl.runtime.turns import Seat, Table
from qrl.server.embedded import die_with_parent
from qrl.wire.codec import CodecError
from qrl.wire.connection import RedisUnavailable, connect, failure_exit, url_user
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)

# what the process server imports once, before it forks role processes (torch._dynamo: what
# a learner's first torch.optim optimizer imports, 1.4 s here, paid once instead of per learner)
PRELOAD = [
    "torch",
    "torch._dynamo",
    "gymnasium",
    "qrl.jobs.launch",
    "qrl.actors.weights",
    "qrl.learners.base",
]


class LaunchError(RuntimeError):
    """A role could not start (no Redis, no such run, a checkpoint that does not fit...)."""


@dataclass(frozen=True)
class RoleSpec:
    """One role process: which role of which run, and its options."""

    algo: str
    role: str
    run: str
    redis_url: str | None = None
    ident: int | Literal["auto"] = "auto"
    limit: int | None = None  # stop after its counter advanced this much (steps, updates...)
    device: str = "auto"
    threads: int = 1
    checkpoint: Path | None = None
    run_dir: Path | None = None  # its checkpoint's place, and where a role that logs the run
    # writes metrics.csv and TensorBoard files
    checkpoint_every: float = 60.0
    redis_deadline: float | None = None
    tracking: Tracking | None = None  # where the run's log goes besides CSV (with run_dir)
    nice: int = 0  # added to the process's niceness at its start (lower CPU priority)
    snapshot: Path | None = None  # its learner keeps its state in this snapshot file too
    # the modules env ids may name: those the starting process was told to import (by its
    # user, never by the run's config), so qrl train's roles import what its --env named
    env_modules: tuple[str, ...] = field(default_factory=allowed_env_modules)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
LOG_DATES = "%H:%M:%S"


def setup_logging(level: int, force: bool = True) -> None:
    """qrl's log format at ``level``; without ``force``, only if logging is not set up yet."""
    logging.basicConfig(
        level=max(level, logging.DEBUG), format=LOG_FORMAT, datefmt=LOG_DATES, force=force
    )


def _algorithm(spec: RoleSpec, client: redis.Redis, keys: RunKeys) -> str:
    """The algorithm whose role runs: the spec's, or for a role command that several share
    (``qrl replay``: Ape-X and Ape-X DPG fill one kind of replay) the run's own."""
    command = ALGOS[spec.algo].role(spec.role).command
    found, _ = load_run(client, keys)
    other = ALGOS.get(found)
    if other is not None and any((r.name, r.command) == (spec.role, command) for r in other.roles):
        return found
    return spec.algo


def reporters(client: redis.Redis, keys: RunKeys) -> list[tuple[str, int]]:
    """Every (role, number) that may report in the run of ``keys``, from its config in Redis
    (:meth:`qrl.runtime.algorithm.Algorithm.reporters`): the processes whose metrics a
    follower of the run reads (:class:`qrl.runtime.metrics.MetricsReader`)."""
    name, _ = load_run(client, keys)
    algo = ALGOS[name]
    return algo.reporters(load_run_config(client, keys, name, algo.config))


def run_role(spec: RoleSpec) -> int:
    """Run the role of ``spec`` in this process until the run stops, a signal comes, or its
    limit is reached; returns how far its counter advanced. SIGINT/SIGTERM before the role
    runs end the process with exit code 0. Raises :class:`LaunchError` if it cannot start
    and :class:`qrl.runtime.loop.RoleFailed` if it failed."""
    stopping = threading.Event()
    running = threading.Event()

    def on_signal() -> None:
        stopping.set()  # (and a lost Redis no longer waited for: on_stop_signals)
        if not running.is_set():
            sys.exit(0)  # imports, waiting for Redis: nothing to finish

    if threading.current_thread() is threading.main_thread():
        on_stop_signals(on_signal)
    opener = partial(connect, spec.redis_url, deadline=spec.redis_deadline)
    try:
        allow_env_modules(spec.env_modules)
        keys = RunKeys(spec.run)
        client = connect(spec.redis_url, wait=30, deadline=spec.redis_deadline)
        spec = replace(spec, algo=_algorithm(spec, client, keys))
        algo = ALGOS[spec.algo]
        roledef = algo.role(spec.role)
        cfg = load_run_config(client, keys, algo.name, algo.config)
        check_env_id(cfg.env)  # the config is data: it may name no module to import
    except (RedisUnavailable, RunNotFound, CodecError, ValueError) as e:
        raise LaunchError(str(e)) from e
    if roledef.when is not None and not roledef.when(cfg):
        raise LaunchError(
            f"run {spec.run!r} has no {roledef.name} processes with its config: {roledef.help}"
        )
    # a per-instance user (qrl run join) reaches its own number's keys only
    user = url_user(spec.redis_url)
    mine = user_ident(user, spec.run, roledef.name)
    if mine is not None and spec.ident not in ("auto", mine):
        raise LaunchError(f"user {user} is {roledef.name} {mine}: --id {spec.ident} is not its")
    numbers = algo.numbers(roledef, cfg)  # those whose metrics the run's readers follow
    wanted = spec.ident if mine is None else mine
    if wanted != "auto" and wanted not in numbers:
        raise LaunchError(
            f"{roledef.name} numbers of run {spec.run!r} go from 0 to {numbers.stop - 1} "
            f"(twice the configured count, plus 8): {wanted} is not one"
        )
    if spec.ident == "auto" or mine is not None:
        lease = claim_id(client, keys, roledef.name, algo.count(roledef, cfg), only=mine)
    else:
        lease = hold_id(client, keys, roledef.name, int(spec.ident))
    try:
        return _run(spec, client, opener, keys, cfg, lease.ident, stopping, running)
    finally:
        lease.release()


def _run(
    spec: RoleSpec,
    client: redis.Redis,
    opener: Callable[[], redis.Redis],
    keys: RunKeys,
    cfg: Config,
    ident: int,
    stopping: threading.Event,
    running: threading.Event,
) -> int:
    """Make the role of ``spec`` as process ``ident`` and run it in the role loop."""
    algo = ALGOS[spec.algo]
    roledef = algo.role(spec.role)
    checkpoint = None
    if roledef.checkpoints:
        checkpoint = spec.checkpoint
        if checkpoint is None and spec.run_dir is not None:
            checkpoint = spec.run_dir / "checkpoint.pt"
    # writes the run dir (one process of a pool)
    follows = spec.run_dir is not None and roledef.logs_run and not (roledef.group and ident)
    record = spec.run_dir / "config_changes.jsonl" if follows else None
    live = LiveConfig(client, keys, cfg, record)  # the changes made so far, and the next ones
    cfg = live.cfg
    try:
        env = EnvSpec.of(cfg.env)  # read once: the role gets it, no role makes an env to read it
        ctx = RoleContext(
            client,
            opener,
            keys,
            cfg,
            ident,
            spec.device,
            spec.threads,
            checkpoint,
            env,
            snapshot=spec.snapshot if roledef.checkpoints else None,
        )
        role = roledef.make(ctx)
    except (RuntimeError, ValueError) as e:  # CheckpointError is a ValueError
        raise LaunchError(str(e)) from e
    if role.name != roledef.name:  # its reports would match no declaration
        raise LaunchError(f"{algo.name}'s {roledef.name!r} made a role named {role.name!r}")
    log.info(
        "%s %d of run %r (%s on %s, config %s), pid %d (nice %d) on %s",
        roledef.name,
        ident,
        spec.run,
        algo.name,
        cfg.env,
        cfg.digest(),
        os.getpid(),
        os.nice(0),
        socket.gethostname(),
    )
    done = threading.Event()
    writer = None
    if follows:
        from qrl.runtime.runlog import follow

        described = {"algo": algo.name, "run": spec.run, "config": cfg.to_dict()}
        writer = follow(
            opener,
            keys,
            spec.run_dir,
            done,
            algo.reports,
            algo.reporters(cfg),
            tracking=spec.tracking,
            config=described,
        )
    running.set()
    try:
        return loop.run_role(
            role,
            client,
            keys,
            ident,
            # a live config change is taken in within this interval and a step
            StopFlag(client, keys, interval=0.25, signals=False, local=stopping, live=live),
            limit=spec.limit,
            checkpoint_every=spec.checkpoint_every if roledef.checkpoints else None,
            live=live,
        )
    finally:
        if writer is not None:
            done.set()
            writer.join(timeout=10)


def process_context() -> multiprocessing.context.BaseContext:
    """The start method of role processes, chosen by measurement (docs/benchmarks.md, "Start
    method of role processes"):
    ``fork`` while the caller has started no thread (``qrl train`` forks its roles after it
    imported torch, before it runs any torch op or thread: nothing live is inherited and
    the children share the imports); otherwise ``forkserver`` preloaded with
    :data:`PRELOAD`, never a fork of live threads; ``spawn`` where neither exists."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    if "forkserver" not in methods:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_process(spec: RoleSpec, log_path: Path, name: str) -> multiprocessing.Process:
    """Run ``spec`` in a child process whose output goes to ``log_path``; it gets SIGTERM
    when its parent dies and has its own process group (a terminal's Ctrl-C reaches only the
    parent, which stops the roles in order)."""
    ctx = process_context()
    log.debug("starting %s with %s", name, ctx.get_start_method())
    proc = ctx.Process(target=_process_main, args=(spec, log_path), name=name)
    proc.start()
    return proc  # type: ignore[return-value]


def start_seat(table: Table, spec: RoleSpec, name: str) -> Seat:
    """Run ``spec`` as a thread of this process seated at ``table`` (a one-process run,
    :mod:`qrl.runtime.turns`): it takes turns with the others, and its handle has the exit
    code its process would have had."""
    return table.start(name, partial(role_main, spec))


def _process_main(spec: RoleSpec, log_path: Path) -> None:
    die_with_parent()
    fd = open_appending(log_path, 0o644)  # not through a link planted in the run dir
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    setup_logging(logging.INFO)
    if spec.nice:
        os.nice(spec.nice)
    if code := role_main(spec):
        sys.exit(code)


def role_main(spec: RoleSpec) -> int:
    """Run the role of ``spec`` (:func:`run_role`); the exit code of its process: 1 if it
    could not start or failed, that of :func:`qrl.wire.connection.failure_exit` for Redis
    lost or refusing."""
    try:
        run_role(spec)
    except (LaunchError, RoleFailed) as e:
        log.error("%s", e)
        return 1
    except Exception as e:
        failure = failure_exit(e)
        if failure is None:
            raise
        log.error("%s", failure[1])
        return failure[0]
    return 0
