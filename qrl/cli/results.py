"""What a run left behind: ``qrl plot`` (its learning curve) and ``qrl eval`` (its policy
played)."""

from __future__ import annotations

from pathlib import Path

import click

from qrl.cli.options import (
    env_module_option,
    typed_env,
)


@click.command("plot")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG to write (default RUN_DIR/plot.png).",
)
def plot_cmd(run_dir: Path, out: Path | None) -> None:
    """Draw a run's learning curve with its evaluations and target, its loss and its
    throughput (from RUN_DIR/metrics.csv and result.json) as a PNG."""
    try:
        from qrl.runtime.plot import plot_run
    except ImportError as e:  # pragma: no cover
        raise click.ClickException(f"{e}; install matplotlib (pip install 'qrl-rl[plot]')") from e
    try:
        path = plot_run(run_dir, out)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {path}")


@click.command("eval")
@click.argument(
    "source", metavar="RUN_DIR|CHECKPOINT", type=click.Path(exists=True, path_type=Path)
)
@click.option(
    "--episodes",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Episodes to play (one env each, in parallel).",
)
@env_module_option
@click.option(
    "--env",
    "env_id",
    default=None,
    callback=typed_env,
    help="Evaluate on this env id instead (same observation and action spaces).",
)
@click.option(
    "--video",
    "video_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Record every episode as an MP4 in this directory (pip install 'qrl-rl[video]').",
)
@click.option(
    "--seed", type=int, default=12345, show_default=True, help="Episode I uses seed SEED+I."
)
def eval_cmd(
    source: Path, episodes: int, env_id: str | None, video_dir: Path | None, seed: int
) -> None:
    """Play episodes with a trained policy (greedy) from a run directory (its
    checkpoint.pt) or a checkpoint file; print the mean, std, min and max return."""
    import importlib.util

    import numpy as np

    from qrl.jobs.policy import load_policy
    from qrl.rl.evaluate import check_same_spaces, evaluate

    if video_dir is not None and importlib.util.find_spec("moviepy") is None:
        raise click.ClickException("--video needs moviepy: pip install 'qrl-rl[video]'")
    try:
        p = load_policy(source)
        env_id = env_id or p.env_id
        if env_id != p.env_id:
            check_same_spaces(p.env_id, env_id)
        returns = np.array(evaluate(env_id, p.act, episodes, seed=seed, video_dir=video_dir))
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(
        f"{env_id}: mean return {returns.mean():.2f}, std {returns.std():.2f}, "
        f"min {returns.min():.2f}, max {returns.max():.2f} over {episodes} episodes "
        f"({p.algo} step {p.step})"
    )
    if video_dir is not None:
        click.echo(f"videos in {video_dir}")


def register(main: click.Group) -> None:
    for cmd in (plot_cmd, eval_cmd):
        main.add_command(cmd)
