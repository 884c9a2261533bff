"""``qrl train ALGO``: a whole job in one command (one subcommand per algorithm, made from
its builder); :func:`qrl.jobs.train.run_training` does the work."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from qrl.algos import ALGOS, Algorithm
from qrl.cli.options import (
    VERBOSE,
    ConfigProblem,
    build_config,
    config_options,
    device_option,
    redis_option,
    run_keys,
    stack,
    track_options,
    tracking,
    typed_env,
)


@click.group("train")
def train_group() -> None:
    """Run a whole training job in one command: Redis, roles, progress, evaluation."""


_job_options = stack(
    redis_option("Join this Redis instead of starting an embedded one. Default: $QRL_REDIS_URL."),
    click.option(
        "--run",
        envvar="QRL_RUN",
        default=None,
        help="Run name (default: $QRL_RUN, else ALGO-ENV-sSEED-TIME).",
    ),
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
        "(default: the env's reward threshold; -200 for Pendulum-v1).",
    ),
    click.option(
        "--max-time",
        type=float,
        default=None,
        help="Wall-clock budget in seconds (default 90 unless --max-steps or --max-updates).",
    ),
    click.option("--max-steps", type=int, default=None, help="Env-step budget."),
    click.option(
        "--max-updates",
        type=click.IntRange(min=1),
        default=None,
        help="Stop once the learner made this many updates (exactly: it stops itself).",
    ),
    click.option(
        "--eval-every",
        type=float,
        default=0.5,
        show_default=True,
        help="Seconds between evaluations (at least four times what the last one took: "
        "evaluation keeps under a fifth of the time).",
    ),
    click.option(
        "--eval-episodes",
        type=int,
        default=10,
        show_default=True,
        help="Episodes per evaluation.",
    ),
    click.option(
        "--confirm-episodes",
        type=click.IntRange(min=0),
        default=100,
        show_default=True,
        help="An evaluation that reaches the target is confirmed on this many fresh "
        "episodes before the job counts as solved (0: no confirmation).",
    ),
    click.option(
        "--actor-nice",
        type=click.IntRange(0, 19),
        default=10,
        show_default=True,
        help="Niceness added to the actor processes, so that on a shared machine the "
        "learner gets the CPU first (0: the same priority as the learner; ES workers are "
        "never niced).",
    ),
    click.option(
        "--eval-env",
        default=None,
        callback=typed_env,
        help="Evaluate on this env id instead of the training env (same observation and "
        "action spaces), e.g. an unslowed or unwrapped twin.",
    ),
    click.option(
        "--acl",
        is_flag=True,
        help="Run every process as a Redis ACL user of its own, which reaches only what its "
        "role needs (each actor, stepper or worker its own number's keys); passwords in "
        "RUN_DIR/acl. Needs Redis 7 or later (--redis, or QRL_REDIS_SERVER for the embedded one).",
    ),
    click.option(
        "--one-process",
        is_flag=True,
        help="Run every role in this one process: threads that take turns in a fixed order "
        "(a step of each role in turn; a role that would wait hands its turn on), so the run "
        "is deterministic for a seed: the same seed and config give the same weights after "
        "the same updates (with --max-updates N, the same checkpoint). For a debugger's "
        "breakpoints in any role and for reproducible runs; it uses one core. It runs one "
        "learner (no pool), one parameter-server shard, and roles that can take turns (no "
        "central inference).",
    ),
    track_options,
)


def train_command(algo: Algorithm) -> click.Command:
    counts = list(dict.fromkeys(r.count for r in algo.roles if r.count))
    torch_roles = any(r.device for r in algo.roles)

    def cmd(
        env: str | None,
        seed: int | None,
        config_file: Path | None,
        overrides: tuple[str, ...],
        redis_url: str | None,
        run: str | None,
        run_dir: Path | None,
        target_return: float | None,
        max_time: float | None,
        max_steps: int | None,
        max_updates: int | None,
        eval_every: float,
        eval_episodes: int,
        confirm_episodes: int,
        actor_nice: int,
        eval_env: str | None,
        acl: bool,
        one_process: bool,
        track: bool,
        wandb_project: str,
        wandb_entity: str | None,
        device: str = "auto",
        **count_values: int | None,
    ) -> None:
        track_to = tracking(track, wandb_project, wandb_entity)
        cfg = build_config(algo, config_file, overrides, env=env, seed=seed, **count_values)
        from qrl.jobs.train import Budget, default_run_name, default_target, run_training  # torch

        run = run or default_run_name(algo.name, cfg.env, cfg.seed)
        run_keys(run)  # an invalid name is a usage error (exit 2), before anything starts
        if eval_env is not None:
            import gymnasium as gym

            from qrl.rl.evaluate import check_same_spaces

            try:
                check_same_spaces(cfg.env, eval_env)
            except (ValueError, gym.error.Error) as e:
                raise ConfigProblem(f"--eval-env: {e}") from None
        budget = Budget(
            target_return if target_return is not None else default_target(eval_env or cfg.env),
            max_time if max_time is not None else (None if max_steps or max_updates else 90.0),
            max_steps,
            max_updates,
            eval_every,
            eval_episodes,
            confirm_episodes,
            eval_env,
        )
        if budget.target_return is None:
            click.echo(
                f"{cfg.env} has no reward threshold in its registration: the job runs its "
                "whole budget; pass --target-return R to stop when the evaluation reaches R",
                err=True,
            )
        from qrl.jobs.acl import AclRefused
        from qrl.jobs.train import OneProcessRefused
        from qrl.runtime.runs import RunExists, RunUnreadable

        try:
            code = run_training(
                algo,
                cfg,
                budget,
                redis_url=redis_url,
                run=run,
                run_dir=run_dir or Path("runs") / run,
                device=device,
                tracking=track_to,
                nice=actor_nice,
                acl=acl,
                one_process=one_process,
            )
        # e.g. --run names another run, or --one-process a run it cannot run
        except (RunExists, RunUnreadable, AclRefused, OneProcessRefused) as e:
            raise ConfigProblem(str(e)) from None
        sys.exit(code)

    for field in counts:
        cmd = click.option(
            f"--{field}",
            field,
            type=int,
            default=None,
            help=algo.config.model_fields[field].description,
        )(cmd)
    if torch_roles:
        cmd = device_option(cmd)
    cmd = config_options(_job_options(VERBOSE(cmd)))
    return click.command(algo.name, help=algo.summary)(cmd)


for _algo in ALGOS.values():
    train_group.add_command(train_command(_algo))


def register(main: click.Group) -> None:
    main.add_command(train_group)
