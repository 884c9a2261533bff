"""``qrl run create|list|set|stop|delete``: runs in a Redis, without starting anything."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import click

from qrl.algos import ALGOS
from qrl.cli.options import (
    ConfigProblem,
    build_config,
    config_options,
    connect_or_fail,
    redis_and_run,
    redis_option,
    run_keys,
)
from qrl.runtime.config import Config

log = logging.getLogger("qrl")


@click.group("run")
def run_group() -> None:
    """Create, list, stop and delete runs in a Redis (nothing is started)."""


@run_group.command("create")
@click.argument("algo", type=click.Choice(sorted(ALGOS)))
@redis_and_run
@config_options
@click.option(
    "--acl",
    "acl_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also create an ACL user per role (RUN.ROLE) limited to what that role needs, "
    "with the password in the file ACL_DIR/ROLE (made, random, where missing), and load "
    "qrl's Lua scripts, which those users may run but not load. Needs an admin "
    "connection; roles then connect as redis://RUN.ROLE@HOST:PORT/0 with "
    "QRL_REDIS_PASSWORD_FILE=ACL_DIR/ROLE.",
)
def run_create(
    algo: str,
    redis_url: str | None,
    run: str,
    env: str | None,
    seed: int | None,
    config_file: Path | None,
    overrides: tuple[str, ...],
    acl_dir: Path | None,
) -> None:
    """Write a run's configuration to Redis without starting anything; roles started with
    --run NAME then join it.

    \b
      qrl run create apex --run cartpole --env CartPole-v1 --set lr=5e-4
      qrl run create impala --run lunar --config lunar.toml
    """
    from qrl.runtime.control import clear_stop
    from qrl.runtime.runs import RunExists, RunUnreadable, create_run

    cfg = build_config(ALGOS[algo], config_file, overrides, env=env, seed=seed)
    keys = run_keys(run)
    if acl_dir is not None:
        _check_admin_password(redis_url)
    client = connect_or_fail(redis_url)
    if acl_dir is not None:
        _check_acl_server(client)
    try:
        created = create_run(client, keys, algo, cfg)
    except (RunExists, RunUnreadable) as e:
        raise click.ClickException(str(e)) from None
    clear_stop(client, keys)  # roles of a re-created run do not stop at once
    click.echo(
        f"{'created' if created else 'kept (identical config)'} run {run}: {algo} on {cfg.env}"
    )
    log.info("config: %s", cfg.to_dict())
    if acl_dir is not None:
        _create_users(client, algo, keys, acl_dir, cfg)


def _check_admin_password(redis_url: str | None) -> None:
    """``run create --acl`` refuses the example admin password before connecting."""
    from redis.connection import parse_url

    from qrl.jobs.acl import check_password
    from qrl.wire.connection import RedisUnavailable, default_url, env_password

    try:
        password = parse_url(redis_url or default_url()).get("password") or env_password()
        check_password(password, "the admin password")
    except (ValueError, RedisUnavailable) as e:
        raise click.ClickException(str(e)) from None


def _check_acl_server(client: Any) -> None:
    """``run create --acl`` refuses a Redis without read-only key patterns before it writes
    anything (the run included)."""
    from qrl.jobs.acl import require_selectors

    try:
        require_selectors(client)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _create_users(client: Any, algo: str, keys: Any, folder: Path, cfg: Config) -> None:
    """``run create --acl``: one ACL user per role, with its password file."""
    from qrl.jobs.acl import create_users
    from qrl.wire.connection import RedisUnavailable

    try:
        users = create_users(client, ALGOS[algo], keys, folder, cfg)
    except (ValueError, OSError, RedisUnavailable) as e:
        raise click.ClickException(str(e)) from None
    for role, (user, path) in users.items():
        click.echo(f"ACL user {user} for {role}: password in {path}")


@run_group.command("join")
@click.argument("run")
@click.argument("role")
@click.option(
    "--id",
    "ident",
    type=click.IntRange(min=0),
    default=None,
    help="The process number the user is for (default: the smallest without a user).",
)
@click.option(
    "--acl",
    "acl_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="The folder of the password file, ACL_DIR/ROLE.N (always a new password).",
)
@redis_option()
def run_join(run: str, role: str, ident: int | None, acl_dir: Path, redis_url: str | None) -> None:
    """Issue one machine its own ACL user for one process of ROLE in RUN, RUN.ROLE.N: what
    the role's user may do, but of the keys of one process (heartbeats, lease, metrics, a
    stepper's request and reply lists) only its own, so a machine that is taken cannot pose
    as another. A process connecting as that user is process N. Needs the admin and Redis 7.

    \b
      qrl run join lunar actor --acl ~/.qrl/lunar      # prints the user and password file
      QRL_REDIS_URL=redis://lunar.actor.0@redis-host:6379/0 \\
        QRL_REDIS_PASSWORD_FILE=~/.qrl/lunar/actor.0 qrl actor impala --run lunar
    """
    from qrl.jobs.acl import join_user
    from qrl.runtime.runs import RunNotFound, RunUnreadable, load_run_config
    from qrl.wire.codec import CodecError
    from qrl.wire.connection import RedisUnavailable

    keys = run_keys(run, "RUN")
    _check_admin_password(redis_url)
    client = connect_or_fail(redis_url)
    try:
        algo = ALGOS[_run_algo(client, keys)]
        cfg = load_run_config(client, keys, algo.name, algo.config)
        user, n, path = join_user(client, algo, keys, cfg, role, ident, acl_dir)
    except (RunNotFound, RunUnreadable, CodecError, KeyError, ValueError, OSError) as e:
        raise click.ClickException(str(e).strip("'\"")) from None
    except RedisUnavailable as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"ACL user {user} for {role} {n}: password in {path}")


@run_group.command("revoke")
@click.argument("run")
@click.argument("role")
@click.argument("ident", metavar="N", type=click.IntRange(min=0))
@redis_option()
def run_revoke(run: str, role: str, ident: int, redis_url: str | None) -> None:
    """Delete the ACL user of process N of ROLE in RUN (qrl run join) on every node, which
    drops its connections, and the keys of that process (heartbeats, lease, metrics, reply
    list)."""
    from qrl.jobs.acl import revoke_user
    from qrl.runtime.ids import instance_user
    from qrl.runtime.runs import RunNotFound, RunUnreadable
    from qrl.wire.connection import RedisUnavailable

    keys = run_keys(run, "RUN")
    client = connect_or_fail(redis_url)
    try:
        gone = revoke_user(client, ALGOS[_run_algo(client, keys)], keys, role, ident)
    except (RunNotFound, RunUnreadable, KeyError, RedisUnavailable) as e:
        raise click.ClickException(str(e).strip("'\"")) from None
    click.echo(f"revoked {instance_user(run, role, ident)} ({gone} keys of it deleted)")


def _run_algo(client: Any, keys: Any) -> str:
    """The algorithm of run ``keys``, one this qrl has."""
    from qrl.runtime.runs import load_run

    algo, _ = load_run(client, keys)
    if algo not in ALGOS:
        raise click.ClickException(f"run {keys.run!r} is of an algorithm this qrl lacks: {algo!r}")
    return algo


@run_group.command("rule")
@click.argument("run")
@click.argument("algo", required=False, type=click.Choice(sorted(ALGOS)))
@click.argument("role", required=False)
@click.option("--user", default="runner", show_default=True, help="The user's name.")
def run_rule_command(run: str, algo: str | None, role: str | None, user: str) -> None:
    """Print the ACL rule of one user for every role of RUN (instead of per-role users, `run
    create --acl`): its keys, the commands a run needs, and qrl's Lua scripts by SHA, the only
    ones it may run. With ALGO and ROLE, the rule of that role's user RUN.ROLE instead, as
    `run create --acl` sets it (Redis 7): its keys, its commands and the scripts its role
    runs. Replace SECRET with its password and run it as the admin, e.g. in redis-cli; then
    load the scripts with `qrl run scripts`.

    \b
      qrl run rule demo --user runner
      qrl run rule demo apex actor
    """
    from qrl.jobs.acl import role_rule, run_rule

    run = run_keys(run, "RUN").run
    if role is not None:
        try:
            click.echo(role_rule(ALGOS[algo], run, role))  # type: ignore[index]
        except KeyError as e:
            raise click.ClickException(str(e).strip("'\"")) from None
    elif algo is not None:
        raise click.UsageError("ALGO and ROLE go together: the rule of that role's user")
    else:
        click.echo(run_rule(run, user))


@run_group.command("scripts")
@redis_option()
def run_scripts_command(redis_url: str | None) -> None:
    """Load qrl's Lua scripts into every node of the Redis (a cluster's replicas too). ACL
    users may run them but not load them: run this as the admin after a Redis restart or
    failover lost them (roles wait for them, one log line each, meanwhile). `run create
    --acl` loads them too."""
    from redis.exceptions import NoPermissionError

    from qrl.wire.scripts import load_scripts

    try:
        n = load_scripts(connect_or_fail(redis_url))
    except NoPermissionError as e:
        raise click.ClickException(f"Redis refused: NOPERM {e} (run this as the admin)") from None
    click.echo(f"loaded {n} scripts")


@run_group.command("list")
@redis_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def run_list(redis_url: str | None, as_json: bool) -> None:
    """List the runs in a Redis."""
    from qrl.runtime.runs import list_runs

    runs = list_runs(connect_or_fail(redis_url))
    if as_json:
        click.echo(json.dumps(runs, indent=2))
        return
    if not runs:
        click.echo("no runs")
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from qrl.runtime.status import printable

    table = Table("run", "algo", "env", "created", "state")
    for r in printable(runs):  # what came from Redis: shown as text, never obeyed as markup
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"] or 0))
        state = "stopped" if r["stopped"] else ""
        table.add_row(*map(Text, (r["run"], r["algo"], r["env"], created, state)))
    Console().print(table)


@run_group.command("set")
@click.argument("run")
@click.argument("pairs", nargs=-1, required=True, metavar="KEY=VALUE...")
@redis_option()
def run_set(run: str, pairs: tuple[str, ...], redis_url: str | None) -> None:
    """Change fields of running run RUN's config: its roles take the change in between two
    steps (within about a second). Only live fields may change (marked "(live)" by `qrl
    config show ALGO`: learning rates, loss weights, exploration), to values the config
    accepts; `qrl status` shows the version and every value changed so far.

    \b
      qrl run set cartpole lr=1e-4
      qrl run set lunar lr=3e-4 entropy_cost=0.005
    """
    from qrl.runtime.config import ConfigError, parse_overrides
    from qrl.runtime.live import MAX_VERSION, set_live
    from qrl.runtime.runs import RunNotFound, RunUnreadable
    from qrl.runtime.status import collect

    keys = run_keys(run, "RUN")
    client = connect_or_fail(redis_url)
    try:
        changes = parse_overrides(pairs)
        algo = _run_algo(client, keys)
        # roles take only versions above the one they run: count on from the highest any
        # reports, should the stored one have gone (deleted, or overwritten by someone)
        taken = [p["values"].get("config_version") for p in collect(client, keys)["processes"]]
        floor = max((v for v in taken if type(v) is int and 0 <= v < MAX_VERSION), default=0)
        state, _ = set_live(client, keys, ALGOS[algo].config, changes, floor)
    except (RunNotFound, RunUnreadable) as e:
        raise click.ClickException(str(e)) from None
    except ConfigError as e:
        raise ConfigProblem(str(e)) from None
    click.echo(f"run {run}: {state.line(state.changed)}")
    log.info("run %s: %s", run, state.line())


@run_group.command("stop")
@redis_and_run
def run_stop(redis_url: str | None, run: str) -> None:
    """Ask every role of a run to stop (they finish their in-flight batch and exit 0)."""
    from qrl.runtime.control import request_stop

    keys = run_keys(run)
    request_stop(connect_or_fail(redis_url), keys)
    click.echo(f"asked run {run} to stop")


@run_group.command("delete")
@click.argument("name")
@redis_option()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def run_delete(name: str, redis_url: str | None, yes: bool) -> None:
    """Delete every key of run NAME (config, weights, streams, replay, metrics) and its
    per-instance ACL users (`qrl run join`'s, `qrl train --acl`'s: NAME.ROLE.N), which would
    otherwise hold their numbers and their access should a run of that name come back."""
    from redis.exceptions import NoPermissionError

    from qrl.jobs.acl import delete_users, joined_users
    from qrl.runtime.runs import delete_run

    keys = run_keys(name, "NAME")
    client = connect_or_fail(redis_url)
    try:
        users: list[str] | None = joined_users(client, name)
    except NoPermissionError:  # not the admin: it made none, and may delete none
        users = None
    if (
        not users
        and not client.exists(keys.config)
        and not any(client.scan_iter(keys.pattern(), count=100))
    ):
        raise click.ClickException(f"no run {name!r} in this Redis")
    if not yes:
        click.confirm(f"Delete run {name!r} and all its data?", abort=True)
    n = delete_run(client, keys)
    if users is None:
        click.echo(f"deleted run {name} ({n} keys; its ACL users are the admin's to delete)")
        return
    delete_users(client, users)
    click.echo(f"deleted run {name} ({n} keys, {len(users)} joined ACL users)")


def register(main: click.Group) -> None:
    main.add_command(run_group)
