"""A run's metrics on disk: ``metrics.csv``, TensorBoard event files and (``--track``)
Weights & Biases.

:class:`Progress` folds the run's metrics (every process's reports) into one row of
stable columns, as the roles declare (:class:`qrl.runtime.roles.Feed`): the columns every
run has (:data:`qrl.runtime.roles.COLUMNS`) and any its roles add. :class:`RunLog` appends
that row to ``metrics.csv`` and hands its scalars to the sinks of
:mod:`qrl.runtime.tracking` under the columns' tags (``charts/...``, ``losses/...``), with
env steps as the x axis. ``qrl train`` does this in its own process; a role that logs the
run (a learner, the ES master) started by hand does it with ``--run-dir`` (:func:`follow`).
``qrl plot RUN_DIR`` draws ``metrics.csv`` (:mod:`qrl.runtime.plot`).
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import os
import reprlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis

from qrl.runtime.files import open_appending
from qrl.runtime.metrics import MetricsReader
from qrl.runtime.roles import COLUMNS, ENV_STEPS, EVAL_RETURN, EVALS, TIME, Column, Feed, Reports
from qrl.runtime.status import finite_values
from qrl.runtime.tracking import Tracking, open_sinks
from qrl.wire.faults import warn_once
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)

MAX_COUNT = 10**15  # larger counters are not believed (their sums must fit TensorBoard's int64)
# sources a sum follows at once: a report from another one forgets the one heard from
# longest ago (a report's id is the number of the stream it came from, below
# qrl.runtime.ids.id_limit, 8,200 for the most actors a config allows; a feed's ``by`` value
# is the report's own say, bounded only where the feed gives a ``bound``)
MAX_IDS = 10_000
RECENT = 50  # the numbers a ``recent`` feed averages


def _put(latest: dict[int, Any], ident: int, value: Any) -> None:
    """``latest[ident] = value``, ``latest`` kept to the :data:`MAX_IDS` ids heard from last
    (a dict keeps insertion order: the first one is the oldest)."""
    latest.pop(ident, None)
    latest[ident] = value
    if len(latest) > MAX_IDS:
        del latest[next(iter(latest))]


def _shape(column: Column, x: float | None) -> float | None:
    """``x`` as ``column`` keeps it: a count clamped to :data:`MAX_COUNT`, else rounded;
    ``None`` if there is none or it is not finite (finite reports can still add up past the
    largest float)."""
    if x is None or not math.isfinite(x):
        return None
    if column.count:
        return min(int(x), MAX_COUNT)
    return round(x, column.digits)


def _checked(name: str, x: Any, count: bool, where: str) -> float | None:
    """A reported (finite) value ``x`` if it is a number (a ``count``: a whole number from 0
    to :data:`MAX_COUNT`), else ``None``, logged once."""
    if isinstance(x, list) or (count and not 0 <= x <= MAX_COUNT):
        what = f"count from 0 to {MAX_COUNT}" if count else "number"
        warn_once(
            f"{where}:{name}",
            "ignoring %s=%s from %s: not a %s",
            name,
            reprlib.repr(x),
            where,
            what,
            kind="bad value",
            logger=log,
        )
        return None
    return int(x) if count else float(x)


class _Fold:
    """The state of one declared feed: what its column shows so far."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.latest: dict[int, float] = {}  # sum: by source
        self.last: float | None = None
        self.items = 0
        self.recent: deque[float] = deque(maxlen=RECENT)

    def take(self, ident: int, values: dict[str, Any], where: str) -> bool:
        """Fold one report's (finite) ``values`` in; False if it had nothing for this feed."""
        f = self.feed
        x = values.get(f.metric)
        if x is None:
            return False
        if f.how in ("items", "recent"):
            if not isinstance(x, list):
                return False
            if f.how == "items":
                self.items = min(self.items + len(x), MAX_COUNT)
            else:
                self.recent.extend(float(i) for i in x)
            return True
        x = _checked(f.metric, x, f.column.count, where)
        if x is None:
            return False
        if f.how == "last":
            self.last = x
            return True
        key = ident if f.by is None else _checked(f.by, values.get(f.by, 0), True, where)
        if key is None or (f.bound is not None and key >= f.bound):
            return False
        _put(self.latest, int(key), x)
        return True

    def value(self) -> float | None:
        how = self.feed.how
        if how == "sum":
            return sum(self.latest.values())
        if how == "items":
            return self.items
        if how == "recent":
            return sum(self.recent) / len(self.recent) if self.recent else None
        return self.last


class Progress:
    """The run so far, folded from its metrics as its roles declare (``reports``:
    role name -> :class:`qrl.runtime.roles.Reports`). Reports of a role not declared are
    ignored."""

    def __init__(self, reports: Mapping[str, Reports]) -> None:
        self.start = time.monotonic()
        self.folds = {role: [_Fold(f) for f in r.progress] for role, r in reports.items()}
        columns = {c.name: c for c in COLUMNS}
        for folds in self.folds.values():
            for fold in folds:
                columns.setdefault(fold.feed.column.name, fold.feed.column)
        self.columns = list(columns.values())
        self.source: dict[str, _Fold] = {}  # column -> the feed that reported to it last
        self.eval_return: float | None = None
        self.evals = 0

    def record_eval(self, score: float) -> None:
        """A new evaluation's mean return."""
        self.eval_return = score
        self.evals += 1

    def fold(self, msg: dict[str, Any]) -> None:
        """Take one metrics report in. Whoever can write the run's keys can send anything
        the metrics schema admits: a value that is not a finite number (a count: not a
        whole number from 0 to :data:`MAX_COUNT`) is ignored and logged once, never fatal."""
        role, ident = msg["role"], msg["id"]
        folds = self.folds.get(role)
        if not folds:
            return
        where = f"metrics of {role}.{ident}"
        values, _ = finite_values(msg["values"], where, lists=True)
        for fold in folds:
            if fold.take(ident, values, where):
                self.source[fold.feed.column.name] = fold

    def value(self, column: Column) -> float | None:
        """``column``'s value now, as the row shows it."""
        if column is TIME:
            x: float | None = time.monotonic() - self.start
        elif column is EVAL_RETURN:
            x = self.eval_return
        elif column is EVALS:
            x = self.evals
        elif column.name in self.source:
            x = self.source[column.name].value()
        else:
            x = column.start
        return _shape(column, x)

    def row(self) -> dict[str, Any]:
        """One row: every logged column's value."""
        return {c.name: self.value(c) for c in self.columns if c.logged}

    @property
    def extra(self) -> dict[str, float]:
        """The values shown in ``qrl train``'s table only, of those reported so far."""
        shown = {c.name: self.value(c) for c in self.columns if not c.logged}
        return {k: v for k, v in shown.items() if k in self.source and v is not None}


class RunLog:
    """Appends :class:`Progress` rows to ``RUN_DIR/metrics.csv`` and their scalars to the
    sinks ``tracking`` names (at most one row per ``every`` seconds); an evaluation's return
    goes to the sinks only in the row where it is new. ``run`` and ``config`` name and
    describe the run to W&B."""

    def __init__(
        self,
        run_dir: Path,
        every: float = 0.5,
        tracking: Tracking | None = None,
        run: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.every, self._next = every, 0.0
        self._file = os.fdopen(open_appending(run_dir / "metrics.csv"), "a+", newline="")
        self._csv: csv.DictWriter | None = None  # made by the first row: it has the columns
        self._evals = 0
        try:
            self._sinks = open_sinks(run_dir, tracking or Tracking(), run, config)
        except BaseException:
            self._file.close()
            raise

    def _writer(self, columns: list[str]) -> csv.DictWriter:
        """The CSV writer of ``columns``: a restarted role appends to its run's metrics (a
        file of other columns starts afresh)."""
        header = ",".join(columns)
        self._file.seek(0)
        keep = self._file.readline(len(header) + 2).strip() == header
        if not keep:
            self._file.seek(0)
            self._file.truncate()
        self._file.seek(0, os.SEEK_END)
        writer = csv.DictWriter(self._file, fieldnames=columns)
        if not keep:
            writer.writeheader()
        return writer

    def write(self, progress: Progress, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.every
        row = progress.row()
        if self._csv is None:
            self._csv = self._writer(list(row))
        self._csv.writerow(row)
        self._file.flush()
        scalars = {
            c.tag: row[c.name]
            for c in progress.columns
            if c.logged and c.tag is not None and row[c.name] is not None
        }
        if row[EVALS.name] == self._evals:
            scalars.pop(EVAL_RETURN.tag, None)  # not a new measurement
        self._evals = row[EVALS.name]
        for sink in self._sinks:
            try:
                sink.log(scalars, row[ENV_STEPS.name])
            except Exception as e:  # noqa: BLE001 - a sink's failure must not end the run
                warn_once(
                    f"sink {id(sink)}", "%s failed (%s): row not logged there", sink, e, logger=log
                )
        return True

    def close(self) -> None:
        self._file.close()
        for sink in self._sinks:
            sink.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def follow(
    connect: Callable[[], redis.Redis],
    keys: RunKeys,
    run_dir: Path,
    stop: threading.Event,
    reports: Mapping[str, Reports],
    sources: list[tuple[str, int]],
    every: float = 1.0,
    tracking: Tracking | None = None,
    config: dict[str, Any] | None = None,
) -> threading.Thread:
    """Follow the run's metrics from their start in a daemon thread (its own Redis
    connection), writing ``run_dir``'s metrics.csv and the sinks of ``tracking`` until
    ``stop``; ``reports`` are the run's roles' declarations (:class:`Progress`), ``sources``
    the processes that may report (:class:`qrl.runtime.metrics.MetricsReader`)."""

    def loop() -> None:
        client = connect()
        reader = MetricsReader(client, keys, sources, from_start=True)
        progress = Progress(reports)
        with RunLog(run_dir, every, tracking, keys.run, config) as out:
            while not stop.is_set():
                try:
                    for msg in reader.read(block_ms=500):
                        progress.fold(msg)
                except redis.ConnectionError as e:
                    log.warning("metrics log: %s; retrying", e)
                    time.sleep(1.0)
                    continue
                out.write(progress)
            with contextlib.suppress(redis.RedisError):  # what came before the stop, all of it
                while msgs := reader.read():
                    for msg in msgs:
                        progress.fold(msg)
            out.write(progress, force=True)

    thread = threading.Thread(target=loop, name="qrl-runlog", daemon=True)
    thread.start()
    return thread
