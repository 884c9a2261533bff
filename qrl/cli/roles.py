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
    if role.logs_run:
        track = tracking(opts.pop("track"), opts.pop("wandb_project"), opts.pop("wandb_entity"))
        if track.wandb and opts["run_dir"] is None:
            raise click.UsageError(f"--track needs --run-dir (the {role.name} logs the run)")
        opts["tracking"] = track
    spec = RoleSpec(algo.name, role.name, redis_deadline=settings().redis_deadline, **opts)
    try:
        run_role(spec)
    except (LaunchError, RoleFailed) as e:
        raise click.ClickException(str(e)) from None


_checkpoint_option = click.option(
    "--checkpoint",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Checkpoint file: resumed from if it exists, written periodically and on exit.",
)
_checkpoint_every_option = click.option(
    "--checkpoint-every",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds between checkpoints (the first after 10 s; one also on a clean stop).",
)


def _run_dir_option(role: RoleDef) -> Any:
    checkpoint = "the checkpoint, unless --checkpoint says otherwise"
    if role.logs_run:
        writes = "Write the run's metrics.csv and TensorBoard files here"
        writes += f" (and {checkpoint})." if role.checkpoints else "."
    else:
        writes = f"Write {checkpoint} here."
    return click.option(
        "--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help=writes
    )


def _limit_option(role: RoleDef) -> Any:
    return click.option(
        f"--max-{role.reports.counter}",
        "limit",
        type=int,
        default=None,
        help=f"Stop after this many {role.limit}.",
    )


_device_options = stack(
    device_option,
    click.option("--threads", type=int, default=1, show_default=True, help="torch CPU threads."),
)


def role_command(algo: Algorithm, role: RoleDef) -> click.Command:
    """The command that starts ``role``, with the options its declaration asks for (in the
    order ``--help`` lists them)."""

    def cmd(**opts: Any) -> None:
        _run(algo, role, **opts)

    wanted = [
        (role.device, _device_options),
        (role.checkpoints, _checkpoint_option),
        (role.checkpoints or role.logs_run, _run_dir_option(role)),
        (role.checkpoints, _checkpoint_every_option),
        (role.logs_run, track_options),
        (role.limit is not None, _limit_option(role)),
        (role.count is not None, id_option(role.name)),
    ]
    cmd = stack(*(options for needed, options in wanted if needed))(cmd)
    cmd = redis_and_run(env_module_option(VERBOSE(cmd)))
    return click.command(role.command[-1], help=role.help)(cmd)


def register(main: click.Group) -> None:
    """Add every role's command; a command that several algorithms' roles share (``qrl
    replay``) once, with the first one's options: it serves the run's own algorithm
    (:func:`qrl.jobs.launch.run_role` finds it)."""
    groups: dict[str, click.Group] = {}
    seen: set[tuple[str, ...]] = set()
    for algo in ALGOS.values():
        for role in algo.roles:
            if role.command in seen:
                continue
            seen.add(role.command)
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
