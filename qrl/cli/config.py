"""``qrl config show ALGO``: every config field of an algorithm, its value and its doc."""

from __future__ import annotations

import json
from pathlib import Path

import click

from qrl.algos import ALGOS
from qrl.cli.options import build_config, config_options


@click.group("config")
def config_group() -> None:
    """Show an algorithm's configuration (every field, its default, its meaning)."""


@config_group.command("show")
@click.argument("algo", type=click.Choice(sorted(ALGOS)))
@config_options
@click.option(
    "--toml",
    "as_toml",
    is_flag=True,
    help="Print a TOML file (for --config FILE) instead of a table.",
)
def show(
    algo: str,
    env: str | None,
    seed: int | None,
    config_file: Path | None,
    overrides: tuple[str, ...],
    as_toml: bool,
) -> None:
    """Every field of ALGO's config with its value (the default, or what --env, --config and
    --set make it) and its one-line doc; values that differ from the default (an image env's
    own defaults, where the algorithm has some) are marked, and so are the fields `qrl run
    set` may change while the run runs ("(live)").

    \b
      qrl config show apex
      qrl config show impala --env LunarLander-v3 --toml > lunar.toml
    """
    from qrl.runtime.config import live_fields

    a = ALGOS[algo]
    live = live_fields(a.config)
    cfg = build_config(a, config_file, overrides, check=False, env=env, seed=seed)
    values = cfg.to_dict()
    defaults = a.config.model_construct().to_dict()
    if env is not None and a.config.image_defaults:  # an image env's defaults are its own
        env_defaults = build_config(a, None, (), check=False, env=env).to_dict()
        defaults.update({k: env_defaults[k] for k in a.config.image_defaults})
    fields = a.config.model_fields
    if as_toml:
        click.echo(f"# qrl config show {algo}: every field of {a.config.__name__}\n[{algo}]")
        for name, value in values.items():
            click.echo(f"# {fields[name].description}")
            click.echo(f"{name} = {json.dumps(value)}")  # JSON scalars and lists are TOML
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("field", "value", "default", "meaning", box=None, title=a.config.__name__)
    for name, value in values.items():
        changed = value != defaults.get(name)
        table.add_row(
            name,
            f"[bold]{json.dumps(value)}[/]" if changed else json.dumps(value),
            "" if not changed else json.dumps(defaults.get(name)),
            ("(live) " if name in live else "") + (fields[name].description or ""),
        )
    Console(width=None if click.get_text_stream("stdout").isatty() else 160).print(table)


def register(main: click.Group) -> None:
    main.add_command(config_group)
