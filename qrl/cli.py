"""The ``qrl`` command line: one click group, a subcommand for every role."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from qrl import __version__
from qrl.algos import ALGOS, Algo

log = logging.getLogger("qrl")

REDIS_OPTION_HELP = (
    "Redis URL (redis://, rediss://, unix://; user:password@ allowed). Default: $QRL_REDIS_URL."
)


def setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        datefmt="%H:%M:%S",
    )


class QrlGroup(click.Group):
    """The root group: Redis going away for longer than the deadline ends any command with
    one clear line and exit code 3, and an ACL refusal with one line and exit code 1, not a
    traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from redis.exceptions import NoPermissionError

        from qrl.connection import RedisUnavailable

        try:
            return super().invoke(ctx)
        except RedisUnavailable as e:
            click.echo(f"Error: {e}", err=True)
            ctx.exit(3)
        except NoPermissionError as e:
            click.echo(f"Error: Redis refused: NOPERM {e} (check the user's ACL rules)", err=True)
            ctx.exit(1)


@click.group(cls=QrlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qrl")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.option(
    "--redis-deadline",
    type=float,
    envvar="QRL_REDIS_DEADLINE",
    default=60.0,
    show_default=True,
    help="Seconds to keep retrying a lost Redis before exiting with code 3 "
    "(env QRL_REDIS_DEADLINE).",
)
def main(verbose: int, redis_deadline: float) -> None:
    """qrl: distributed reinforcement learning coordinated through Redis.

    \b
    One machine, everything in one command (embedded Redis):
      qrl train apex --env CartPole-v1
    A cluster: run `qrl redis` (or your own Redis), then start roles anywhere with
    --redis URL --run NAME.
    """
    setup_logging(verbose)
    # SIGTERM before a role is running (imports, waiting for Redis) is a clean stop too;
    # once it runs, its stop flag takes the signal over and finishes the batch in flight
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    os.environ["QRL_REDIS_DEADLINE"] = str(redis_deadline)  # roles started from here inherit it


@main.command("redis")
@click.option("--port", type=int, default=0, help="Port to listen on (default: a free one).")
@click.option("--bind", "host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--password", default=None, help="Require this password (requirepass).")
@click.option("--appendonly", is_flag=True, help="Persist with an append-only file in --dir.")
@click.option(
    "--dir",
    "data_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Data directory (default: a temporary one, removed on exit).",
)
def redis_cmd(
    port: int, host: str, password: str | None, appendonly: bool, data_dir: str | None
) -> None:
    """Run a private redis-server in the foreground and print its URL; Ctrl-C stops it."""
    from qrl.embedded import EmbeddedRedis

    server = EmbeddedRedis(port, host, data_dir=data_dir, appendonly=appendonly, password=password)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except (OSError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    try:
        click.echo(server.url)
        click.echo(
            f"redis-server {server.binary} (pid {server.proc.pid}); Ctrl-C to stop", err=True
        )
        sys.stdout.flush()
        while not stop.is_set() and server.proc.poll() is None:
            stop.wait(0.5)
        if not stop.is_set():
            raise click.ClickException(f"redis-server exited with {server.proc.returncode}")
    finally:
        server.stop()
    click.echo("redis-server stopped", err=True)


def redis_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--redis and --run, shared by every role."""
    f = click.option(
        "--run",
        "run",
        envvar="QRL_RUN",
        required=True,
        help="Run name (all its keys share qrl:{RUN}:). Default: $QRL_RUN.",
    )(f)
    return click.option(
        "--redis", "redis_url", envvar="QRL_REDIS_URL", default=None, help=REDIS_OPTION_HELP
    )(f)


def _join(redis_url: str | None, run: str, algo: str, cls: type) -> tuple[Any, Any, Any]:
    """Connect and read the run's config: all a joining role needs is the URL and run name."""
    from qrl.codec import CodecError
    from qrl.config import RunNotFound, load_run_config
    from qrl.connection import RedisUnavailable, connect
    from qrl.keys import RunKeys

    try:
        keys = RunKeys(run)
        client = connect(redis_url, wait=30)
        return client, keys, load_run_config(client, keys, algo, cls)
    except (RedisUnavailable, RunNotFound, CodecError, ValueError) as e:
        raise click.ClickException(str(e)) from e


def parse_overrides(
    cls: type, pairs: tuple[str, ...], base: dict[str, Any] | None = None, **direct: Any
) -> Any:
    """A ``cls`` config from ``base`` (e.g. a config file), then options, then ``--set
    key=value`` pairs (typed by the dataclass)."""
    from qrl.config import from_dict

    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = dict(base or {})
    values.update({k: v for k, v in direct.items() if v is not None})
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in hints:
            names = ", ".join(f.name for f in dataclasses.fields(cls))
            raise click.BadParameter(
                f"{pair!r}: expected KEY=VALUE with KEY one of: {names}", param_hint="--set"
            )
        hint = hints[key]
        try:
            if typing.get_origin(hint) is tuple:
                values[key] = tuple(int(x) for x in raw.split(",") if x)
            elif hint is bool:
                values[key] = raw.lower() in ("1", "true", "yes", "on")
            elif hint in (int, float):
                values[key] = hint(float(raw)) if hint is int and "e" in raw.lower() else hint(raw)
            else:
                values[key] = raw
        except ValueError as e:
            raise click.BadParameter(f"{pair!r}: {e}", param_hint="--set") from e
    try:
        return from_dict(cls, values)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--set") from e


class IdParam(click.ParamType):
    """A process number, or ``auto``: the next free number of that role in the run (so
    ``docker compose --scale actor=8`` gives eight different actors)."""

    name = "N|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or value == "auto":
            return value
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a number or 'auto'", param, ctx)
        if n < 0:
            self.fail(f"{n} is negative", param, ctx)
        return n


def _resolve_id(client: Any, keys: Any, role: str, ident: int | str) -> int:
    if ident != "auto":
        return int(ident)
    n = int(client.hincrby(keys.ids, role, 1)) - 1
    log.info("%s got --id %d", role, n)
    return n


def id_option(role: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--id",
        "ident",
        type=IdParam(),
        default="auto",
        show_default=True,
        help=f"{role.capitalize()} number (sets its seeds; for Ape-X actors the epsilon); "
        f"auto = the run's next free {role} number.",
    )


def _leave(client: Any, keys: Any, role: str, ident: int) -> None:
    """A role that stopped cleanly takes its heartbeat out of ``qrl status``."""
    from qrl.status import leave

    leave(client, keys, role, ident)


def _stop_flag(client: Any, keys: Any) -> Any:
    from qrl.control import StopFlag

    return StopFlag(client, keys)


@main.group("run")
def run_group() -> None:
    """Create, list, stop and delete runs in a Redis (nothing is started)."""


def _connect_or_fail(redis_url: str | None) -> Any:
    from qrl.connection import RedisUnavailable, connect

    try:
        return connect(redis_url, wait=10)
    except RedisUnavailable as e:
        raise click.ClickException(str(e)) from e


def _read_config_file(path: Path, algo: str) -> dict[str, Any]:
    """Config fields from a TOML file: top-level keys, overridden by an ``[ALGO]`` table
    (tables of other algorithms are ignored, so one file can serve all three)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise click.BadParameter(f"{path}: {e}", param_hint="--config") from e
    values = {k: v for k, v in data.items() if not isinstance(v, dict)}
    unknown = [k for k, v in data.items() if isinstance(v, dict) and k not in ALGOS]
    if unknown:
        raise click.BadParameter(
            f"{path}: unexpected tables {unknown} (fields go at the top level or in an "
            f"[{'|'.join(sorted(ALGOS))}] table)",
            param_hint="--config",
        )
    values.update(data.get(algo, {}))  # the [ALGO] table overrides the shared fields
    return values


@run_group.command("create")
@click.argument("algo", type=click.Choice(sorted(ALGOS)))
@redis_options
@click.option("--env", default=None, help="Gymnasium environment id (default: the config's).")
@click.option("--seed", type=int, default=None, help="Random seed (default 0).")
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="TOML file of config fields (top level or an [ALGO] table); options override it.",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any config field, e.g. --set lr=5e-4 --set hidden=128,128.",
)
def run_create(
    algo: str,
    redis_url: str | None,
    run: str,
    env: str | None,
    seed: int | None,
    config_file: Path | None,
    overrides: tuple[str, ...],
) -> None:
    """Write a run's configuration to Redis without starting anything; roles started with
    --run NAME then join it.

    \b
      qrl run create apex --run cartpole --env CartPole-v1 --set lr=5e-4
      qrl run create impala --run lunar --config lunar.toml
    """
    from qrl.config import RunExists, create_run, to_dict
    from qrl.keys import RunKeys

    spec = ALGOS[algo]
    base = _read_config_file(config_file, algo) if config_file else None
    cfg = parse_overrides(spec.config, overrides, base, env=env, seed=seed)
    try:
        keys = RunKeys(run)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--run") from e
    client = _connect_or_fail(redis_url)
    try:
        created = create_run(client, keys, algo, cfg)
    except RunExists as e:
        raise click.ClickException(str(e)) from e
    client.hdel(keys.control, "stop")  # roles of a re-created run do not stop at once
    click.echo(
        f"{'created' if created else 'kept (identical config)'} run {run}: {algo} on {cfg.env}"
    )
    log.info("config: %s", to_dict(cfg))


@run_group.command("list")
@click.option("--redis", "redis_url", envvar="QRL_REDIS_URL", default=None, help=REDIS_OPTION_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def run_list(redis_url: str | None, as_json: bool) -> None:
    """List the runs in a Redis."""
    import json
    import time

    from qrl.config import list_runs

    runs = list_runs(_connect_or_fail(redis_url))
    if as_json:
        click.echo(json.dumps(runs, indent=2))
        return
    if not runs:
        click.echo("no runs")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("run", "algo", "env", "created", "state")
    for r in runs:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"] or 0))
        table.add_row(r["run"], r["algo"], r["env"], created, "stopped" if r["stopped"] else "")
    Console().print(table)


@run_group.command("stop")
@redis_options
def run_stop(redis_url: str | None, run: str) -> None:
    """Ask every role of a run to stop (they finish their in-flight batch and exit 0)."""
    from qrl.control import request_stop
    from qrl.keys import RunKeys

    request_stop(_connect_or_fail(redis_url), RunKeys(run))
    click.echo(f"asked run {run} to stop")


@run_group.command("delete")
@click.argument("name")
@click.option("--redis", "redis_url", envvar="QRL_REDIS_URL", default=None, help=REDIS_OPTION_HELP)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def run_delete(name: str, redis_url: str | None, yes: bool) -> None:
    """Delete every key of run NAME (config, weights, streams, replay, metrics)."""
    from qrl.config import delete_run
    from qrl.keys import RunKeys

    try:
        keys = RunKeys(name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="NAME") from e
    client = _connect_or_fail(redis_url)
    if not client.exists(keys.config) and not any(client.scan_iter(keys.pattern(), count=100)):
        raise click.ClickException(f"no run {name!r} in this Redis")
    if not yes:
        click.confirm(f"Delete run {name!r} and all its data?", abort=True)
    n = delete_run(client, keys)
    click.echo(f"deleted run {name} ({n} keys)")


@main.command("status")
@click.option("--redis", "redis_url", envvar="QRL_REDIS_URL", default=None, help=REDIS_OPTION_HELP)
@click.option(
    "--run", envvar="QRL_RUN", default=None, help="Run name (default: $QRL_RUN, or the only run)."
)
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option(
    "--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes."
)
@click.option(
    "--stale-after",
    type=float,
    default=10.0,
    show_default=True,
    help="Flag a process whose last heartbeat is older than this many seconds.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (for scripts).")
def status_cmd(
    redis_url: str | None,
    run: str | None,
    watch: bool,
    interval: float,
    stale_after: float,
    as_json: bool,
) -> None:
    """Every live process of a run, throughput per role, streams and consumer-group lag,
    replay size, weight version, policy lag and dead letters; stale heartbeats flagged."""
    import json
    import time

    from qrl.config import list_runs
    from qrl.keys import RunKeys
    from qrl.status import collect, render

    client = _connect_or_fail(redis_url)
    if run is None:
        runs = [r["run"] for r in list_runs(client)]
        if len(runs) != 1:
            raise click.UsageError(f"pass --run (runs in this Redis: {', '.join(runs) or 'none'})")
        run = runs[0]
    keys = RunKeys(run)
    if not client.exists(keys.config):
        raise click.ClickException(f"no run {run!r} in this Redis")
    if as_json:
        while True:
            click.echo(json.dumps(collect(client, keys, stale_after)))
            if not watch:
                return
            time.sleep(interval)
    from rich.console import Console
    from rich.live import Live

    console = Console() if sys.stdout.isatty() else Console(width=160)  # pipes: no wrapping
    if not watch:
        console.print(render(collect(client, keys, stale_after)))
        return
    with Live(
        render(collect(client, keys, stale_after)), console=console, auto_refresh=False
    ) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(collect(client, keys, stale_after)), refresh=True)
        except KeyboardInterrupt:
            pass


@main.command("plot")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG to write (default RUN_DIR/plot.png).",
)
def plot_cmd(run_dir: Path, out: Path | None) -> None:
    """Draw a run's learning curve and throughput (from RUN_DIR/metrics.csv) as a PNG."""
    try:
        from qrl.plot import plot_run
    except ImportError as e:  # pragma: no cover
        raise click.ClickException(f"{e}; install matplotlib (pip install 'qrl[plot]')") from e
    try:
        path = plot_run(run_dir, out)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {path}")


@main.command("replay")
@redis_options
@id_option("replay")
def replay_cmd(redis_url: str | None, run: str, ident: int | str) -> None:
    """Drain a run's experience stream into its prioritized replay (several may run)."""
    from qrl.configs import ApexConfig
    from qrl.replay.role import ReplayFiller

    client, keys, cfg = _join(redis_url, run, "apex", ApexConfig)
    ident = _resolve_id(client, keys, "replay", ident)
    filler = ReplayFiller(client, keys, cfg, ident)
    n = filler.run(_stop_flag(client, keys))
    _leave(client, keys, "replay", ident)
    log.info("replay %d stopped after inserting %d transitions", ident, n)


@main.group()
def actor() -> None:
    """Start an actor that joins a run (needs --redis and --run)."""


@main.group()
def learner() -> None:
    """Start a learner for a run (needs --redis and --run)."""


@main.group()
def train() -> None:
    """Run a whole training job in one command: Redis, roles, progress, evaluation."""


@main.group()
def es() -> None:
    """Evolution Strategies roles: master and workers (needs --redis and --run)."""


GROUPS = {"actor": actor, "learner": learner, "es": es}


DEVICE = click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Where the learner trains: auto = CUDA if available.",
)


def _actor_command(algo: Algo) -> None:
    group, name = algo.actor_cmd
    role = "worker" if group == "es" else "actor"

    @GROUPS[group].command(
        name, help=f"An {algo.name} {role}: joins the run, plays, pushes results."
    )
    @redis_options
    @id_option(role)
    @click.option("--max-steps", type=int, default=None, help="Stop after this many env steps.")
    def cmd(redis_url: str | None, run: str, ident: int | str, max_steps: int | None) -> None:
        client, keys, cfg = _join(redis_url, run, algo.name, algo.config)
        ident = _resolve_id(client, keys, role, ident)
        steps = algo.actor_cls()(client, keys, cfg, ident).run(
            _stop_flag(client, keys), max_steps=max_steps
        )
        _leave(client, keys, role, ident)
        log.info("actor %d stopped after %d env steps", ident, steps)


def _learner_command(algo: Algo) -> None:
    group, name = algo.learner_cmd
    torch_opts = [
        DEVICE,
        click.option(
            "--threads", type=int, default=1, show_default=True, help="torch CPU threads."
        ),
    ]

    role = "master" if group == "es" else "learner"

    @GROUPS[group].command(
        name, help=f"The {algo.name} {role} of a run: trains and publishes the weights."
    )
    @redis_options
    @click.option(
        "--checkpoint",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Checkpoint file: resumed from if it exists, written periodically and on exit.",
    )
    @click.option(
        "--run-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Write the run's metrics.csv and TensorBoard files here (and the checkpoint, "
        "unless --checkpoint says otherwise).",
    )
    @click.option(
        "--checkpoint-every",
        type=float,
        default=60.0,
        show_default=True,
        help="Seconds between checkpoints (one is also written on a clean stop).",
    )
    @click.option("--max-updates", type=int, default=None, help="Stop after this many updates.")
    def cmd(
        redis_url: str | None,
        run: str,
        checkpoint: Path | None,
        run_dir: Path | None,
        checkpoint_every: float,
        max_updates: int | None,
        device: str = "cpu",
        threads: int = 1,
    ) -> None:
        from qrl.checkpoint import CheckpointError
        from qrl.connection import connect
        from qrl.runlog import follow

        client, keys, cfg = _join(redis_url, run, algo.name, algo.config)
        if run_dir is not None and checkpoint is None:
            checkpoint = run_dir / "checkpoint.pt"
        extra = {"device": device, "threads": threads} if algo.torch_learner else {}
        try:
            lrn = algo.learner_cls()(
                lambda: connect(redis_url), keys, cfg, checkpoint=checkpoint, **extra
            )
        except (CheckpointError, RuntimeError, ValueError) as e:
            raise click.ClickException(str(e)) from e
        done = threading.Event()
        writer = follow(lambda: connect(redis_url), keys, run_dir, done) if run_dir else None
        n = lrn.run(_stop_flag(client, keys), max_updates, checkpoint_every=checkpoint_every)
        _leave(client, keys, role, 0)
        if writer is not None:
            done.set()
            writer.join(timeout=10)
        log.info("%s %s stopped after %d updates", algo.name, name, n)

    if algo.torch_learner:
        for opt in torch_opts:
            cmd = opt(cmd)


def train_options(f: Callable[..., Any]) -> Callable[..., Any]:
    opts = [
        click.option(
            "--env", default=None, help="Gymnasium environment id (default: the config's)."
        ),
        click.option("--seed", type=int, default=None, help="Random seed (default 0)."),
        click.option(
            "--redis",
            "redis_url",
            default=None,
            help="Join this Redis instead of starting an embedded one.",
        ),
        click.option("--run", default=None, help="Run name (default: ALGO-ENV-sSEED-TIME)."),
        click.option(
            "--run-dir",
            type=click.Path(file_okay=False, path_type=Path),
            default=None,
            help="Where config, metrics.csv, logs and checkpoint go (default runs/RUN).",
        ),
        click.option(
            "--target-return",
            type=float,
            default=None,
            help="Stop with success once the evaluation mean reaches this "
            "(default: the env's reward threshold).",
        ),
        click.option(
            "--max-time",
            type=float,
            default=None,
            help="Wall-clock budget in seconds (default 90 unless --max-steps).",
        ),
        click.option("--max-steps", type=int, default=None, help="Env-step budget."),
        click.option(
            "--eval-every",
            type=float,
            default=1.0,
            show_default=True,
            help="Seconds between evaluations.",
        ),
        click.option("--eval-episodes", type=int, default=10, show_default=True),
        click.option(
            "--set",
            "overrides",
            multiple=True,
            metavar="KEY=VALUE",
            help="Override any config field, e.g. --set lr=5e-4 --set hidden=128,128.",
        ),
        DEVICE,
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _target(env: str, given: float | None) -> float | None:
    if given is not None:
        return given
    import gymnasium as gym

    try:
        return gym.spec(env).reward_threshold
    except gym.error.Error:
        return None


def _train_command(algo: Algo, doc: str) -> None:
    count = algo.count_field

    @train.command(algo.name, help=doc)
    @train_options
    @click.option(
        f"--{count}",
        "actors",
        type=int,
        default=None,
        help=f"{count.capitalize()} processes (default 2).",
    )
    @click.option(
        "--replays",
        type=int,
        default=1,
        show_default=True,
        hidden=algo.stream_role is None,
        help="Replay-filling processes.",
    )
    def cmd(
        env: str | None,
        seed: int | None,
        actors: int | None,
        redis_url: str | None,
        run: str | None,
        run_dir: Path | None,
        target_return: float | None,
        max_time: float | None,
        max_steps: int | None,
        eval_every: float,
        eval_episodes: int,
        overrides: tuple[str, ...],
        device: str,
        replays: int,
    ) -> None:
        import torch

        from qrl.train import Budget, default_run_name, run_training

        torch.set_num_threads(1)  # this process only evaluates; the cores are the roles'
        algo.actor_cls(), algo.learner_cls()  # imported once here, inherited by forked roles
        cfg = parse_overrides(algo.config, overrides, env=env, seed=seed, **{count: actors})
        run = run or default_run_name(algo.name, cfg.env, cfg.seed)
        run_dir = run_dir or Path("runs") / run
        budget = Budget(
            _target(cfg.env, target_return),
            max_time if max_time is not None else (None if max_steps else 90.0),
            max_steps,
            eval_every,
            eval_episodes,
        )
        code = run_training(
            algo.name,
            cfg,
            algo.roles(cfg, device, run_dir, replays),
            evaluator := _Evaluator(algo, cfg, eval_episodes),
            budget,
            redis_url=redis_url,
            run=run,
            run_dir=run_dir,
        )
        checkpoint = run_dir / "checkpoint.pt"
        if code == 0 and algo.torch_learner and evaluator.last and checkpoint.exists():
            # the learner kept training after the evaluation that reached the target: keep
            # the weights that reached it, not whatever came after
            from qrl.checkpoint import replace_model

            version, params = evaluator.last
            replace_model(checkpoint, params, version)
        sys.exit(code)


class _Evaluator:
    """Evaluation of the latest published parameters (only when they changed); ``last`` is
    ``(version, params)`` of the weights evaluated last."""

    def __init__(self, algo: Algo, cfg: Any, episodes: int) -> None:
        self.algo, self.cfg, self.episodes = algo, cfg, episodes
        self.score: float | None = None
        self.last: tuple[int, dict[str, Any]] | None = None

    def __call__(self, client: Any, keys: Any) -> float | None:
        import numpy as np

        from qrl.evaluate import evaluate
        from qrl.weights import WeightStore

        store = WeightStore(client, keys, getattr(keys, self.algo.weights_key))
        w = store.fetch(self.last[0] if self.last else -1)
        if w is not None:
            self.last = (w.version, w.params)
            act = self.algo.policy(self.cfg, w.params)
            seed = self.cfg.seed * 1000 + 7
            self.score = float(np.mean(evaluate(self.cfg.env, act, self.episodes, seed=seed)))
        return self.score


TRAIN_DOCS = {
    "apex": """Ape-X: replay, learner and actor processes around one Redis; exits 0 iff the
    greedy evaluation reached the target return (1: budget ran out, 2: a role failed).

    \b
    qrl train apex --env CartPole-v1 --seed 0
    qrl train apex --env LunarLander-v3 --max-time 1200 --eval-every 30 --set lr=5e-4
    """,
    "impala": """IMPALA: learner and actor processes around one Redis, V-trace off-policy
    correction; exits 0 iff the greedy evaluation reached the target return (1: budget ran
    out, 2: a role failed).

    \b
    qrl train impala --env CartPole-v1 --seed 0
    qrl train impala --env LunarLander-v3 --max-time 1200 --eval-every 30
    """,
    "es": """Evolution Strategies: a master and --workers worker processes around one Redis;
    exits 0 iff the center policy's evaluation reached the target return (1: budget ran out,
    2: a role failed).

    \b
    qrl train es --env CartPole-v1 --workers 2
    qrl train es --env Pendulum-v1 --target-return -250 --max-time 1200 --eval-every 30
    """,
}

for _algo in ALGOS.values():
    _actor_command(_algo)
    _learner_command(_algo)
    _train_command(_algo, TRAIN_DOCS[_algo.name])


@main.command("eval")
@click.argument("checkpoint", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--episodes", type=int, default=10, show_default=True)
@click.option("--seed", type=int, default=12345, show_default=True)
def eval_cmd(checkpoint: Path, episodes: int, seed: int) -> None:
    """Play episodes with a saved policy (greedy) and print the mean return."""
    import numpy as np

    from qrl.checkpoint import CheckpointError, load_checkpoint
    from qrl.config import from_dict
    from qrl.evaluate import evaluate

    try:
        state = load_checkpoint(checkpoint)
        algo = ALGOS.get(state["algo"])
        if algo is None:
            raise CheckpointError(f"unknown algorithm {state['algo']!r} in {checkpoint}")
        cfg = from_dict(algo.config, state["config"])
        act = algo.policy(cfg, {k: v.numpy() for k, v in state["model"].items()})
    except (CheckpointError, ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    returns = evaluate(cfg.env, act, episodes, seed=seed)
    click.echo(
        f"{cfg.env}: mean return {np.mean(returns):.2f} over {episodes} episodes "
        f"(min {np.min(returns):.1f}, max {np.max(returns):.1f}; {algo.name} step {state['step']})"
    )


if __name__ == "__main__":
    main()
