"""``qrl plot RUN_DIR``: a PNG of a run's learning curve, loss and throughput from its
metrics.csv (and its target return from result.json)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from qrl.runtime.files import write_atomically


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


def new_evaluations(rows: list[dict[str, str]]) -> list[float | None]:
    """``eval_return`` only in the rows where a new evaluation came (the column repeats the
    last one): where ``evals`` grew, or, in a metrics.csv without it, where the value changed."""
    values = _column(rows, "eval_return")
    counts = _column(rows, "evals")
    marks = counts if any(c is not None for c in counts) else values
    out: list[float | None] = []
    last: float | None = None
    for value, mark in zip(values, marks, strict=True):
        out.append(value if mark is not None and mark != last else None)
        last = mark
    return out


def _target(run_dir: Path) -> float | None:
    try:
        target = json.loads((run_dir / "result.json").read_text()).get("target")
    except (OSError, ValueError, AttributeError):
        return None
    return float(target) if isinstance(target, (int, float)) else None


def draw(run_dir: Path) -> Any:
    """The figure of ``run_dir``: returns against env steps (actors' as a line, evaluations
    as points, the target as a horizontal line), the loss against env steps, env steps/s and
    updates/s against time. Raises ``OSError``/``ValueError`` without metrics."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path} has no rows yet")
    steps, time_s = _column(rows, "env_steps"), _column(rows, "time_s")
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 10), constrained_layout=True)
    x, y = _points(steps, _column(rows, "episodic_return"))
    if y:
        top.plot(x, y, label="actors (last 50 episodes)")
    x, y = _points(steps, new_evaluations(rows))
    if y:  # measurements, not a curve: nothing is known between two evaluations
        top.plot(x, y, linestyle="none", marker="o", color="C1", label="evaluation")
    target = _target(run_dir)
    if target is not None:
        top.axhline(target, linestyle="--", color="C2", label=f"target {target:g}")
    top.set(xlabel="env steps", ylabel="episodic return", title=f"{run_dir.name}: learning curve")
    if top.lines:
        top.legend(loc="lower right")
    top.grid(alpha=0.3)
    x, y = _points(steps, _column(rows, "loss"))
    if y:
        middle.plot(x, y, color="C3")
    else:
        middle.text(0.5, 0.5, "no loss reported", ha="center", va="center")
    middle.set(xlabel="env steps", ylabel="loss", title="learner loss")
    middle.grid(alpha=0.3)
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
    return fig


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write :func:`draw`'s figure of ``run_dir`` as a PNG (default ``RUN_DIR/plot.png``);
    returns its path."""
    fig = draw(run_dir)  # (selects the file-only backend before pyplot is imported)
    import matplotlib.pyplot as plt

    out = out or run_dir / "plot.png"
    write_atomically(out, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)
    return out
