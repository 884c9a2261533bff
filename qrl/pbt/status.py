"""``qrl status --run POPULATION``: a population's trials (who trains each, its segments trained,
its last score, its explored values now), its latest exploit/explore events and its solve."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import redis
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from qrl.pbt.exploit import UNREADABLE, current
from qrl.pbt.population import Population
from qrl.runtime.status import printable


def collect(client: redis.Redis, name: str, events: int = 10) -> dict[str, Any]:
    """The population's status as plain data (``qrl status --json``)."""
    pop = Population(client, name)
    pcfg = pop.config()
    trials = pcfg.trials()
    holders, scores, segments = pop.holders(trials), pop.scores(trials), pop.segments(trials)
    rows = []
    for trial in trials:
        try:
            cfg = current(client, pcfg, trial)
            values = {e.field: getattr(cfg, e.field) for e in pcfg.explore}
        except UNREADABLE:
            values = {}
        rows.append(
            {
                "trial": trial,
                "worker": holders.get(trial),
                "segments": segments[trial],
                "score": scores.get(trial),
                "values": values,
            }
        )
    return {
        "population": name,
        "algo": pcfg.algo,
        "env": pcfg.env,
        "trials": rows,
        "lineage": pop.lineage(trials)[-events:],
        "solved": pop.solved(),
        "target_return": pcfg.target_return,
    }


def _num(x: Any) -> Text:
    """A value read from Redis as plain text: no markup, every control character escaped
    (any worker's user may have written it)."""
    return Text(printable("-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)))


def render(status: dict[str, Any]) -> Group:
    title = (
        f"population {status['population']}: {status['algo']} on {status['env']}, "
        f"target {status['target_return']}"
    )
    trials = Table(title=title)
    fields = list(status["trials"][0]["values"]) if status["trials"] else []
    for col in ("trial", "worker", "segments", "score", *fields):
        trials.add_column(col)
    for row in status["trials"]:
        trials.add_row(
            row["trial"],
            _num(row["worker"]),
            _num(row["segments"]),
            _num(row["score"]),
            *(_num(row["values"].get(f)) for f in fields),
        )
    lineage = Table(title="exploit/explore (latest last)")
    for col in ("when", "trial", "took", "its score", "score", "values"):
        lineage.add_column(col)
    for e in status["lineage"]:
        ago = f"{time.time() - e['time']:.0f}s ago" if isinstance(e.get("time"), float) else "-"
        values = e.get("values") if isinstance(e.get("values"), dict) else {}
        shown = ", ".join(f"{k}={_num(v)}" for k, v in values.items())
        lineage.add_row(
            ago,
            _num(e.get("trial")),
            _num(e.get("source")),
            _num(e.get("source_score")),
            _num(e.get("score")),
            _num(shown),
        )
    solved = status["solved"]
    end = f"solved by {solved['trial']} ({solved['return']:.4g})" if solved else "not solved"
    return Group(trials, lineage, end)


def show(client: redis.Redis, name: str, as_json: bool = False) -> None:
    """Print the population's status (as JSON with ``as_json``)."""
    status = collect(client, name)
    if as_json:
        print(json.dumps(status))
    else:
        Console(width=None if sys.stdout.isatty() else 160).print(render(status))
