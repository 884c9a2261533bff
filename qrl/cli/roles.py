"""The commands that start one role of a run (``qrl actor apex``, ``qrl replay``, ``qrl es
worker``...), made from the algorithms' role definitions: each goes through
:func:`qrl.jobs.launch.run_role`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from qrl.algos import ALGOS, Algorithm, RoleDef
from qrl.cli.options import (
    VERBOSE,
    device_option,
    env_module_option,
    id_option,
    redis_and_run,
    run_keys,
    settings,
    stack,
    track_options,
    tracking,
)


def _run(algo: Algorithm, role: RoleDef, **opts: Any) -> None:
    from qrl.jobs.launch import LaunchError, RoleSpec, run_role
    from qrl.runtime.loop import RoleFailed

    run_keys(opts["run"])  # an invalid name is a usage error (exit 2), before anything starts
    if "track" in opts:  # a learner
        track = tracking(opts.pop("track"), opts.pop("wandb_project"), opts.pop("wandb_entity"))
        if track.wandb and opts["run_dir"] is None:
            raise click.UsageError("--track needs --run-dir (the learner logs the run's metrics)")
        opts["tracking"] = track
    spec = RoleSpec(algo.name, role.name, redis_deadline=settings().redis_deadline, **opts)
    try:
        run_role(spec)
    except (LaunchError, RoleFailed) as e:
        raise click.ClickException(str(e)) from None


def _actor_options(f: Any) -> Any:
    f = click.option(
        "--max-steps", "limit", type=int, default=None, help="Stop after this many env steps."
    )(f)
    return f


_learner_options = stack(
    click.option(
        "--checkpoint",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Checkpoint file: resumed from if it exists, written periodically and on exit.",
    ),
    click.option(
        "--run-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Write the run's metrics.csv and TensorBoard files here (and the "
        "checkpoint, unless --checkpoint says otherwise).",
    ),
    click.option(
        "--checkpoint-every",
        type=float,
        default=60.0,
        show_default=True,
        help="Seconds between checkpoints (the first after 10 s; one also on a clean stop).",
    ),
    track_options,
    click.option(
        "--max-updates", "limit", type=int, default=None, help="Stop after this many updates."
    ),
)


def _torch_options(f: Any) -> Any:
    f = click.option(
        "--threads", type=int, default=1, show_default=True, help="torch CPU threads."
    )(f)
    return device_option(f)


def role_command(algo: Algorithm, role: RoleDef) -> click.Command:
    def cmd(**opts: Any) -> None:
        _run(algo, role, **opts)

    if role.kind == "learner":
        cmd = _learner_options(cmd)
        if role.torch:
            cmd = _torch_options(cmd)
    else:
        cmd = id_option(role.name)(cmd)
        if role.kind == "actor":
            cmd = _actor_options(cmd)
    cmd = redis_and_run(env_module_option(VERBOSE(cmd)))
    return click.command(role.command[-1], help=role.help)(cmd)


def register(main: click.Group) -> None:
    groups: dict[str, click.Group] = {}
    for algo in ALGOS.values():
        for role in algo.roles:
            *path, _ = role.command
            parent = main
            for name in path:
                if name not in groups:
                    groups[name] = click.Group(
                        name, help=f"Start one role of a run: qrl {name} COMMAND --run NAME."
                    )
                    main.add_command(groups[name])
                parent = groups[name]
            parent.add_command(role_command(algo, role))
