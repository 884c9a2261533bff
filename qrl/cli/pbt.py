"""``qrl pbt ALGO``: population-based training in one command (one subcommand per algorithm),
and ``qrl pbt worker NAME``: worker slots on any machine that reaches the population's Redis."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, get_args

import click

from qrl.algos import ALGOS, Algorithm
from qrl.cli.options import (
    VERBOSE,
    ConfigProblem,
    build_config,
    config_options,
    connect_or_fail,
    device_option,
    redis_option,
    run_keys,
    stack,
)
from qrl.pbt.config import PBTConfig, Score, pbt_algos

# what a --pbt-config file may set: the population's settings but those the command sets
_PBT_FIELDS = sorted(
    set(PBTConfig.model_fields) - {"name", "algo", "env", "seed", "overrides", "exploit"}
)


@click.group("pbt")
def pbt_group() -> None:
    """Population-based training: trials explore hyperparameters, the worse copy the better."""


_options = stack(
    redis_option("Join this Redis instead of starting an embedded one. Default: $QRL_REDIS_URL."),
    click.option("--name", default=None, help="Population name (default ALGO-ENV-sSEED-TIME)."),
    click.option(
        "--population", type=click.IntRange(2, 64), default=None, help="Trials (default 4)."
    ),
    click.option(
        "--explore",
        "explore",
        multiple=True,
        metavar="FIELD=RANGE",
        help="An explored live field: FIELD=LOW..HIGH (uniform: lr=1e-5..1e-1 draws 99% "
        "of its values above 1e-3), FIELD=LOW..HIGH:log (log-uniform: each decade alike) or "
        "FIELD=A,B,C (repeat for more).",
    ),
    click.option(
        "--ready",
        "ready_s",
        type=click.FloatRange(min=1),
        default=None,
        help="Seconds a trial trains between exploit/explore points (default 30).",
    ),
    click.option(
        "--ready-steps",
        "ready_steps",
        type=click.IntRange(min=1),
        default=None,
        help="Env steps a trial trains between them (the same on any machine); "
        "--ready then caps a segment's seconds.",
    ),
    click.option(
        "--quantile",
        type=click.FloatRange(0.01, 0.99),
        default=None,
        help="Truncation selection: the bottom quantile copies the top one; past "
        "0.5, the top 1 - quantile (default 0.25).",
    ),
    click.option(
        "--burn-in",
        "burn_in",
        type=click.IntRange(0, 10_000),
        default=None,
        help="Segments a trial trains on its own before it may copy or be copied (default 0).",
    ),
    click.option(
        "--resample",
        type=click.FloatRange(0, 1),
        default=None,
        help="Chance an explored value is redrawn instead of perturbed (default 0.25).",
    ),
    click.option(
        "--score",
        type=click.Choice(get_args(Score)),
        default=None,
        help="What ranks trials: the recent mean return of their training episodes "
        "(default, as the paper does for RL) or their greedy evaluation.",
    ),
    click.option(
        "--random-search",
        "random_search",
        is_flag=True,
        help="No exploit and explore: the same trials, each on its own draw (the "
        "baseline PBT is measured against).",
    ),
    click.option(
        "--slots",
        type=click.IntRange(0, 64),
        default=2,
        show_default=True,
        help="Trials trained at once on this machine (0: only workers elsewhere).",
    ),
    click.option(
        "--target-return",
        type=float,
        default=None,
        help="Solved once a trial's evaluation reaches this, confirmed (default: the "
        "env's reward threshold).",
    ),
    click.option(
        "--max-time",
        type=float,
        default=1800.0,
        show_default=True,
        help="Wall-clock budget in seconds.",
    ),
    click.option(
        "--run-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Where lineage, scores and the trials' dirs go (default runs/NAME).",
    ),
    click.option(
        "--pbt-config",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="TOML file of these settings ([pbt] table or top level: "
        "population, explore = [...], ready_s, quantile, ...); options override it.",
    ),
    click.option(
        "--acl",
        "acl",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        metavar="DIR",
        help="Redis ACL users: NAME.controller (this command, after "
        "it set the population up), one per trial, NAME-tI.worker, which writes only "
        "its trial's keys, and one per process of a trial's segment (its role's keys of "
        "the trial only); passwords in DIR/controller and DIR/NAME-tI (made where "
        "missing). Give a worker machine only its trials' files (`qrl pbt worker NAME "
        "--acl DIR`). The users are deleted as the population ends. Needs Redis 7.",
    ),
)


def _settings(path: Path | None, given: dict[str, Any]) -> dict[str, Any]:
    from qrl.runtime.config import tomllib

    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigProblem(f"{path}: {e}") from None
        data = data.get("pbt", data)
        unknown = set(data) - set(_PBT_FIELDS)
        if unknown:
            raise ConfigProblem(f"{path}: unknown settings {sorted(unknown)} ({_PBT_FIELDS})")
        values.update(data)
    values.update({k: v for k, v in given.items() if v not in (None, ())})
    return values


def pbt_command(algo: Algorithm) -> click.Command:
    def cmd(
        env: str | None,
        seed: int | None,
        config_file: Path | None,
        overrides: tuple[str, ...],
        redis_url: str | None,
        name: str | None,
        slots: int,
        max_time: float,
        run_dir: Path | None,
        pbt_config: Path | None,
        random_search: bool,
        acl: Path | None,
        device: str = "auto",
        **given: Any,
    ) -> None:
        from pydantic import ValidationError

        from qrl.jobs.acl import AclRefused
        from qrl.jobs.train import default_run_name, default_target
        from qrl.pbt.config import Explore, PBTConfig
        from qrl.pbt.controller import run_population
        from qrl.runtime.config import ConfigError, one_line
        from qrl.runtime.live import check_fields

        base = build_config(algo, config_file, overrides, env=env, seed=seed)
        values = _settings(pbt_config, given)
        try:
            values["explore"] = [
                Explore.parse(e) if isinstance(e, str) else e for e in values.get("explore", [])
            ]
            if not values["explore"]:
                raise ValueError("pass at least one --explore FIELD=LOW..HIGH (what PBT varies)")
            check_fields(algo.config, [e.field for e in values["explore"]])
            for e in values["explore"]:
                if (warning := e.warning()) is not None:
                    click.echo(f"warning: {warning}", err=True)
            name = name or default_run_name(algo.name, base.env, base.seed)
            run_keys(name, "--name")
            if values.get("target_return") is None:
                values["target_return"] = default_target(base.env)
            pcfg = PBTConfig(
                name=name,
                algo=algo.name,
                env=base.env,
                seed=base.seed,
                overrides=base.to_dict(),
                exploit=not random_search,
                **values,
            )
        except ValidationError as e:  # (a ValueError too: first)
            raise ConfigProblem(one_line(e, PBTConfig)) from None
        except (ValueError, ConfigError) as e:
            raise ConfigProblem(str(e)) from None
        if pcfg.target_return is None:
            raise ConfigProblem(f"{base.env} has no reward threshold: pass --target-return")
        try:
            code = run_population(
                pcfg,
                redis_url=redis_url,
                slots=slots,
                run_root=run_dir or Path("runs") / name,
                max_time=max_time,
                device=device,
                acl=acl,
            )
        except AclRefused as e:
            raise ConfigProblem(str(e)) from None
        sys.exit(code)

    cmd = device_option(cmd) if any(r.device for r in algo.roles) else cmd
    cmd = config_options(_options(VERBOSE(cmd)))
    summary = f"A population of `qrl train {algo.name}` trials: exploit and explore."
    return click.command(algo.name, help=summary, short_help=summary)(cmd)


@pbt_group.command("worker")
@click.argument("name")
@redis_option()
@click.option(
    "--slots",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Trials this worker trains at once.",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the trials' segment dirs go (default runs/NAME).",
)
@click.option(
    "--acl",
    "acl",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="Train only the trials whose password files (NAME-tI, from `qrl pbt ... "
    "--acl`) are in DIR, each as its own ACL user (the URL's user is not "
    "used).",
)
@device_option
@VERBOSE
def worker(
    name: str,
    redis_url: str | None,
    slots: int,
    run_dir: Path | None,
    acl: Path | None,
    device: str,
) -> None:
    """Train trials of population NAME until it is solved or stopped (`qrl run stop NAME`)."""
    from qrl.pbt.acl import trial_urls
    from qrl.pbt.controller import work
    from qrl.pbt.population import Population, PopulationError
    from qrl.wire.connection import default_url

    run_keys(name, "NAME")
    urls = None
    if acl is not None:
        urls = trial_urls(redis_url or default_url(), name, acl)
        if not urls:
            raise click.ClickException(f"no password file of a trial of {name} in {acl}")
        redis_url = next(iter(urls.values()))
    client = connect_or_fail(redis_url)
    try:
        Population(client, name).config()
    except PopulationError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(work(redis_url, name, run_dir or Path("runs") / name, slots, device, urls))


for _name in pbt_algos():
    pbt_group.add_command(pbt_command(ALGOS[_name]))


def register(main: click.Group) -> None:
    main.add_command(pbt_group)
