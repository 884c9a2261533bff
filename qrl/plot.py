"""``qrl plot RUN_DIR``: a PNG of a run's learning curve and throughput from its metrics.csv."""

from __future__ import annotations

import csv
from pathlib import Path


def _column(rows: list[dict[str, str]], name: str) -> list[float | None]:
    out: list[float | None] = []
    for row in rows:
        try:
            out.append(float(row[name]))
        except (KeyError, TypeError, ValueError):
            out.append(None)
    return out


def _points(xs: list[float | None], ys: list[float | None]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if x is not None and y is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw ``run_dir/metrics.csv``: returns against env steps (top), env steps/s and
    updates/s against time (bottom). Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path} has no rows yet")
    steps, time_s = _column(rows, "env_steps"), _column(rows, "time_s")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), constrained_layout=True)
    for col, label in (("episodic_return", "actors (last 50 episodes)"), ("eval_return", "eval")):
        x, y = _points(steps, _column(rows, col))
        if y:
            top.plot(x, y, label=label)
    top.set(xlabel="env steps", ylabel="episodic return", title=f"{run_dir.name}: learning curve")
    top.legend(loc="lower right")
    top.grid(alpha=0.3)
    # env steps/s and updates/s differ by orders of magnitude: one y axis each
    right = bottom.twinx()
    for ax, col, label, color in (
        (bottom, "env_steps_per_s", "env steps/s", "C0"),
        (right, "updates_per_s", "updates/s", "C1"),
    ):
        x, y = _points(time_s, _column(rows, col))
        ax.plot(x, y, color=color)
        ax.set_ylabel(label, color=color)
    bottom.set(xlabel="seconds", title="throughput")
    bottom.grid(alpha=0.3)
    out = out or run_dir / "plot.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
