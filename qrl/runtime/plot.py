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


def draw_population(run_dir: Path) -> Any:
    """The figure of a ``qrl pbt`` run dir: each trial's score over time (exploits marked:
    the copier's line jumps to the copied trial's), and each explored hyperparameter of each
    trial over time (log scale for log ranges)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = json.loads((run_dir / "pbt.json").read_text())
    with (run_dir / "scores.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    explored = settings.get("explore", [])
    fig, axes = plt.subplots(
        1 + len(explored),
        1,
        figsize=(8, 3.2 * (1 + len(explored))),
        constrained_layout=True,
        squeeze=False,
    )
    trials = sorted({row["trial"] for row in rows})
    events = []
    if (run_dir / "lineage.jsonl").exists():
        events = [json.loads(line) for line in (run_dir / "lineage.jsonl").read_text().splitlines()]
    start = min((float(r["time"]) for r in rows), default=0.0)
    for i, trial in enumerate(trials):
        mine = [r for r in rows if r["trial"] == trial]
        t = [float(r["time"]) for r in mine]
        axes[0][0].plot(t, _column(mine, "score"), marker="o", color=f"C{i}", label=trial)
        for ax, spec in zip((a[0] for a in axes[1:]), explored, strict=True):
            ax.step(t, _column(mine, spec["field"]), where="post", color=f"C{i}")
    target = settings.get("target_return")
    if target is not None:
        axes[0][0].axhline(target, linestyle="--", color="grey", label=f"target {target:g}")
    # pbt.json files from before the score setting ranked by evaluation
    scored = "training return" if settings.get("score", "eval") == "train" else "evaluation"
    axes[0][0].set(
        ylabel=f"score ({scored})", title=f"{run_dir.name}: population ({len(events)} exploits)"
    )
    axes[0][0].legend(loc="lower right", fontsize="small")
    for ax, spec in zip((a[0] for a in axes[1:]), explored, strict=True):
        ax.set(ylabel=spec["field"], yscale="log" if spec["kind"] == "log" else "linear")
    for (ax,) in axes:
        ax.grid(alpha=0.3)
        ax.set_xlabel("seconds")
        ax.set_xlim(left=start)
    return fig


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write :func:`draw`'s figure of ``run_dir`` (:func:`draw_population`'s for a ``qrl pbt``
    run dir) as a PNG (default ``RUN_DIR/plot.png``); returns its path."""
    population = (run_dir / "pbt.json").exists() and (run_dir / "scores.csv").exists()
    fig = (draw_population if population else draw)(run_dir)  # (file-only backend first)
    import matplotlib.pyplot as plt

    out = out or run_dir / "plot.png"
    write_atomically(out, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)
    return out
