"""Reading docker-compose.yml as docker compose does (interpolation from .env.example,
profiles, environments, volumes) and checking a service's command against the real `qrl`
command line; shared by the compose tests."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import yaml

from qrl.algos import ALGOS
from qrl.cli import main
from qrl.runtime.algorithm import Algorithm, RoleDef
from qrl.runtime.config import parse_config
from qrl.runtime.roles import ENV_STEPS
from tests.cli import ROOT

COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
ENV_EXAMPLE = ROOT / ".env.example"

# profile -> service -> the qrl command it runs
PROFILES: dict[str, dict[str, tuple[str, ...]]] = {
    "apex": {
        "init": ("run", "create"),
        "replay": ("replay",),
        "learner": ("learner", "apex"),
        "actor": ("actor", "apex"),
    },
    "impala": {
        "impala-init": ("run", "create"),
        "impala-learner": ("learner", "impala"),
        "impala-actor": ("actor", "impala"),
    },
    "ppo": {
        "ppo-init": ("run", "create"),
        "ppo-learner": ("learner", "ppo"),
        "ppo-actor": ("actor", "ppo"),
    },
    "seed": {
        "seed-init": ("run", "create"),
        "seed-learner": ("learner", "impala"),
        "seed-inference": ("inference", "impala"),
        "seed-stepper": ("stepper", "impala"),
    },
    "seed-r2d2": {
        "seed-r2d2-init": ("run", "create"),
        "seed-r2d2-replay": ("replay",),
        "seed-r2d2-learner": ("learner", "r2d2"),
        "seed-r2d2-inference": ("inference", "r2d2"),
        "seed-r2d2-stepper": ("stepper", "r2d2"),
    },
    "es": {
        "es-init": ("run", "create"),
        "es-master": ("es", "master"),
        "es-worker": ("es", "worker"),
    },
    "apex-dpg": {
        "apex-dpg-init": ("run", "create"),
        "apex-dpg-replay": ("replay",),
        "apex-dpg-learner": ("learner", "apex-dpg"),
        "apex-dpg-actor": ("actor", "apex-dpg"),
    },
    "a3c": {
        "a3c-init": ("run", "create"),
        "a3c-ps": ("ps", "a3c"),
        "a3c-worker": ("worker", "a3c"),
    },
    "r2d2": {
        "r2d2-init": ("run", "create"),
        "r2d2-replay": ("replay",),
        "r2d2-learner": ("learner", "r2d2"),
        "r2d2-actor": ("actor", "r2d2"),
    },
}
ROLES = [(profile, name) for profile, services in PROFILES.items() for name in services]
# a profile is its algorithm's, unless named here, with the config its init sets
ALGO_OF = {"seed": "impala", "seed-r2d2": "r2d2"}
SETS: dict[str, dict[str, Any]] = {p: {"inference": "central"} for p in ("seed", "seed-r2d2")}


def algo_of(profile: str) -> Algorithm:
    return ALGOS[ALGO_OF.get(profile, profile)]


def roles_of(profile: str) -> list[RoleDef]:
    """The roles a run of the profile's config runs."""
    algo = algo_of(profile)
    cfg = parse_config(algo.config, SETS.get(profile, {}))
    return [r for r in algo.roles if r.when is None or r.when(cfg)]


# what makes a role the actor (the one that plays the env: its reports count env steps) or
# the learner (the one that checkpoints), as the roles declare it
KINDS = {
    "actor": lambda role: any(f.column == ENV_STEPS for f in role.reports.progress),
    "learner": lambda role: role.checkpoints,
}


def command_of(profile: str, kind: str) -> tuple[str, ...]:
    """The command of the algorithm's role of ``kind`` (actor or learner, :data:`KINDS`)."""
    (command,) = (r.command for r in roles_of(profile) if KINDS[kind](r))
    return command


def service_of(profile: str, command: tuple[str, ...]) -> str:
    """The service of ``profile`` that runs ``command``."""
    (name,) = (n for n, cmd in PROFILES[profile].items() if cmd == command)
    return name


INIT = {profile: service_of(profile, ("run", "create")) for profile in PROFILES}

# -- reading the files as docker compose does

_VAR = re.compile(r"\$(?:\$|\{(\w+)(?:(:?[-?])([^}]*))?\})")


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a compose ``.env`` file (``#`` comments, blank lines)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            env[key.strip()] = value.strip().strip("'\"")
    return env


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``,
    ``${VAR?error}`` and ``$$``, as docker compose fills them; stricter than compose, an
    unset ``${VAR}`` without default is an error rather than empty."""

    def fill(m: re.Match[str]) -> str:
        name, op, arg = m.groups()
        if name is None:
            return "$"
        value = env.get(name)
        missing = value is None or (value == "" and op is not None and op.startswith(":"))
        if op is not None and op.endswith("-"):
            return arg if missing else value
        if missing:
            raise KeyError(f"${{{name}}} has no value: {arg or 'not in .env.example'}")
        return value

    return _VAR.sub(fill, text)


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    """``node`` (parsed YAML) with every string interpolated."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, env) for v in node]
    return node


EXAMPLE = read_env_file(ENV_EXAMPLE)


def load(path: Path = COMPOSE, env: Mapping[str, str] = EXAMPLE) -> dict[str, Any]:
    """A compose file as ``docker compose`` sees it with ``env`` as its ``.env``."""
    return resolve(yaml.safe_load(path.read_text()), env)


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment, given as a mapping or as a list of ``KEY=VALUE``."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def volume_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> named volume, for the short ``NAME:/PATH`` syntax."""
    return {target: name for name, target in (v.split(":")[:2] for v in service.get("volumes", []))}


def seconds(duration: str) -> float:
    """A compose duration such as ``30s``, ``1m30s``, ``500ms``."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


# -- the real command line, parsed without running anything


def parse_cli(args: list[str]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Parse ``qrl ARGS`` as the entry point would, options read from the environment
    included: returns the command path and the command's parameters. An unknown command or
    option, a bad value or a missing required option raises :class:`click.UsageError`."""
    cmd: click.Command = main
    ctx = main.make_context("qrl", list(args))
    path: list[str] = []
    while isinstance(cmd, click.Group):
        # click >= 8.2 keeps the subcommand's name in _protected_args
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        rest = [*protected, *ctx.args]
        if not rest:
            raise click.UsageError("missing command", ctx)
        name, sub, rest = cmd.resolve_command(ctx, rest)
        assert name is not None and sub is not None
        path.append(name)
        cmd, ctx = sub, sub.make_context(name, rest, parent=ctx)
    return tuple(path), ctx.params
