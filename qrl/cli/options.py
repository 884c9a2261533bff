"""Options shared by the commands, each defined once, and the helpers commands use to turn
them into objects (a Redis client, run keys, a config) with one-line errors."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from qrl.algos import ALGOS, Algorithm

F = Callable[..., Any]


@dataclass
class Settings:
    """What the root group's options set for every command."""

    redis_deadline: float | None = None


def settings() -> Settings:
    ctx = click.get_current_context()
    return ctx.find_object(Settings) or Settings()


def _verbosity(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if value:
        from qrl.jobs.launch import setup_logging

        setup_logging(logging.WARNING - 10 * value)
    return value


VERBOSE = click.option(
    "-v",
    "--verbose",
    count=True,
    expose_value=False,
    is_eager=True,
    callback=_verbosity,
    help="More logging (-v info, -vv debug); before or after the subcommand.",
)


class ConfigProblem(click.ClickException):
    """A bad config value or file: one line, exit code 2 (a usage error)."""

    exit_code = 2


def stack(*options: Callable[[F], F]) -> Callable[[F], F]:
    """Several click options as one decorator, in the order given (as ``--help`` lists)."""

    def apply(f: F) -> F:
        for opt in reversed(options):
            f = opt(f)
        return f

    return apply


def warn_secret_in_argv(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A callback: warn when a password came on the command line, which every user of the
    machine can read (``ps``); the environment and files are private."""
    from click.core import ParameterSource

    from qrl.wire.connection import redact

    given = ctx.get_parameter_source(param.name or "") is ParameterSource.COMMANDLINE
    secret = param.name != "redis_url" or (value is not None and redact(value) != value)
    if value and given and secret:
        click.echo(
            f"Warning: the password in {param.opts[0]} is visible to every user of this "
            f"machine (ps); set QRL_REDIS_PASSWORD (or QRL_REDIS_PASSWORD_FILE) instead",
            err=True,
        )
    return value


def redis_option(help: str | None = None) -> Callable[[F], F]:
    return click.option(
        "--redis",
        "redis_url",
        envvar="QRL_REDIS_URL",
        default=None,
        callback=warn_secret_in_argv,
        help=help
        or "Redis URL (redis://, rediss://, unix://; user:password@ allowed, better the "
        "password in $QRL_REDIS_PASSWORD or a file named by $QRL_REDIS_PASSWORD_FILE). "
        "Default: $QRL_REDIS_URL.",
    )


def run_option(required: bool = True, help: str | None = None) -> Callable[[F], F]:
    return click.option(
        "--run",
        "run",
        envvar="QRL_RUN",
        required=required,  # (no default=None: click >= 8.3 counts that as a default)
        help=help or "Run name (all its keys share qrl:{RUN}:). Default: $QRL_RUN.",
    )


def redis_and_run(f: F) -> F:
    """--redis and --run, for every command that works on one run."""
    return redis_option()(run_option()(f))


def device_option(f: F) -> F:
    return click.option(
        "--device",
        type=click.Choice(["auto", "cpu", "cuda"]),
        default="auto",
        show_default=True,
        help="The torch device: auto = CUDA if available.",
    )(f)


class ModuleNames(click.types.StringParamType):
    """Module names; ``QRL_ENV_MODULES`` lists them separated by commas."""

    name = "MODULE"
    envvar_list_splitter = ","


def _allow_modules(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    from qrl.rl.envs import allow_env_modules

    try:
        allow_env_modules(m.strip() for m in value if m.strip())  # "a,b," is a list too
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


env_module_option = click.option(
    "--env-module",
    type=ModuleNames(),
    multiple=True,
    envvar="QRL_ENV_MODULES",
    expose_value=False,
    callback=_allow_modules,
    help="Import this module for env ids written MODULE:EnvId (repeatable; env "
    "QRL_ENV_MODULES=mod1,mod2). A module named only by a run's config, a checkpoint or a "
    "run directory is never imported: that is data, anyone with the run's keys can write it.",
)


def typed_env(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A callback for an env id option: one typed on the command line is the user's own
    choice, so the module of a ``module:EnvId`` it names is allowed (and passed on to the
    role processes the command starts)."""
    from click.core import ParameterSource

    module, sep, _ = (value or "").partition(":")
    if sep and ctx.get_parameter_source(param.name or "") is ParameterSource.COMMANDLINE:
        _allow_modules(ctx, param, (module,))
    return value


config_options = stack(
    env_module_option,
    click.option(
        "--env",
        default=None,
        callback=typed_env,
        help="Gymnasium environment id (default: the config's); MODULE:EnvId imports MODULE first.",
    ),
    click.option("--seed", type=int, default=None, help="Random seed (default 0)."),
    click.option(
        "--config",
        "config_file",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="TOML file of config fields (top level or an [ALGO] table), or a run's "
        "config.json; options override it.",
    ),
    click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override any config field, e.g. --set lr=5e-4 --set hidden=128,128.",
    ),
)
"""--env, --seed, --config FILE and --set KEY=VALUE (applied in that order of rising
precedence: file, then --env/--seed, then --set)."""


def build_config(
    algo: Algorithm,
    config_file: Path | None,
    overrides: tuple[str, ...],
    check: bool = True,
    **direct: Any,
) -> Any:
    """The config from a file, then the options given (``None``: not given), then --set,
    over the config's image defaults when its env's observations are images; with
    ``check``, its env is made once to check that it exists and that ``algo`` can act in it
    (without, an env that cannot be made gets no image defaults)."""
    from qrl.rl.envspec import EnvSpec, check_env, is_image
    from qrl.runtime.config import ConfigError, parse_config, parse_overrides, read_config_file

    try:
        values = read_config_file(config_file, algo.name, list(ALGOS)) if config_file else {}
        values.update({k: v for k, v in direct.items() if v is not None})
        values.update(parse_overrides(overrides))
        cfg = parse_config(algo.config, values)
        spec = check_env(cfg.env, algo.name, algo.actions) if check else None
        if algo.config.image_defaults:
            if spec is None:
                with contextlib.suppress(ValueError):
                    spec = EnvSpec.of(cfg.env)
            if spec is not None and is_image(spec.obs_shape):
                cfg = parse_config(algo.config, {**algo.config.image_defaults, **values})
        return cfg
    except (ConfigError, ValueError) as e:
        raise ConfigProblem(str(e)) from None


def run_keys(run: str, hint: str = "--run") -> Any:
    from qrl.wire.keys import RunKeys

    try:
        return RunKeys(run)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None


def connect_or_fail(redis_url: str | None, wait: float = 10) -> Any:
    """A client, or one line and exit code 1 if Redis cannot be reached."""
    from qrl.wire.connection import RedisUnavailable, connect

    try:
        return connect(redis_url, wait=wait, deadline=settings().redis_deadline)
    except RedisUnavailable as e:
        raise click.ClickException(str(e)) from None


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


def id_option(role: str) -> Callable[[F], F]:
    return click.option(
        "--id",
        "ident",
        type=IdParam(),
        default="auto",
        show_default=True,
        help=f"{role.capitalize()} number (sets its seeds, and its share of the exploration "
        "where processes explore differently, e.g. Ape-X's epsilons); "
        f"auto = the run's next free {role} number. Numbers go below twice the count the "
        "run is configured for, plus 8.",
    )


track_options = stack(
    click.option(
        "--track",
        is_flag=True,
        help="Also log the metrics to Weights & Biases (pip install 'qrl-rl[wandb]'; "
        "WANDB_MODE=offline keeps them in RUN_DIR/wandb).",
    ),
    click.option(
        "--wandb-project",
        envvar="WANDB_PROJECT",
        default="qrl",
        show_default=True,
        help="W&B project (env WANDB_PROJECT).",
    ),
    click.option(
        "--wandb-entity",
        envvar="WANDB_ENTITY",
        default=None,
        help="W&B entity, a user or team (env WANDB_ENTITY; default: yours).",
    ),
)
"""--track, --wandb-project, --wandb-entity: turned into a Tracking by :func:`tracking`."""


def tracking(track: bool, wandb_project: str, wandb_entity: str | None) -> Any:
    """The :class:`qrl.runtime.tracking.Tracking` the options ask for; one line and exit code 1,
    before anything starts, if ``--track`` is given without wandb installed."""
    from qrl.runtime.tracking import Tracking

    t = Tracking(wandb=track, wandb_project=wandb_project, wandb_entity=wandb_entity)
    try:
        t.check()
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    return t
