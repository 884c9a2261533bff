"""A run's metrics on disk: ``metrics.csv``, TensorBoard event files and (``--track``)
Weights & Biases.

:class:`Progress` folds the run's metrics stream (every role's reports) into one row of
stable columns; :class:`RunLog` appends that row to ``metrics.csv`` and hands its scalars
to the sinks of :mod:`qrl.runtime.tracking` under stable tags (``charts/...``, ``losses/...``),
with env steps as the x axis. ``qrl train`` does this in its own process;
a learner or ES master started by hand does it with ``--run-dir`` (:func:`follow`).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from qrl.runtime.files import open_appending
from qrl.runtime.metrics import MetricsReader
from qrl.runtime.status import finite_values
from qrl.runtime.tracking import Tracking, open_sinks
from qrl.wire.faults import warn_once
from qrl.wire.keys import MAX_SHARDS, RunKeys

log = logging.getLogger(__name__)

# CSV column -> TensorBoard tag (None: CSV only)
COLUMNS: dict[str, str | None] = {
    "time_s": None,
    "env_steps": None,
    "env_steps_per_s": "charts/env_steps_per_s",
    "updates": None,
    "updates_per_s": "charts/updates_per_s",
    "replay_size": "charts/replay_size",
    "episodes": None,
    "episodic_return": "charts/episodic_return",
    "eval_return": "charts/eval_return",  # the last evaluation's mean, repeated
    "evals": None,  # evaluations so far: a row where it grew has a new eval_return
    "loss": "losses/loss",
    "policy_lag": "charts/policy_lag",
}


MAX_COUNT = 10**15  # larger counters are not believed (their sums must fit TensorBoard's int64)
# actors followed at once: a report from another id forgets the one heard from longest ago
# (anyone with the run's keys can report as any id; the numbers qrl hands out stay below
# qrl.runtime.ids.id_limit, 8,200 for the most actors a config allows)
MAX_IDS = 10_000


def _put(latest: dict[int, Any], ident: int, value: Any) -> None:
    """``latest[ident] = value``, ``latest`` kept to the :data:`MAX_IDS` ids heard from last
    (a dict keeps insertion order: the first one is the oldest)."""
    latest.pop(ident, None)
    latest[ident] = value
    if len(latest) > MAX_IDS:
        del latest[next(iter(latest))]


def _r(x: float | None, digits: int = 4) -> float | None:
    """``x`` rounded; ``None`` if there is none or it is not finite (finite reports can still
    add up past the largest float)."""
    return None if x is None or not math.isfinite(x) else round(x, digits)


@dataclass
class Progress:
    """The run so far, folded from its metrics stream."""

    start: float = field(default_factory=time.monotonic)
    actor_steps: dict[int, int] = field(default_factory=dict)
    actor_rate: dict[int, float] = field(default_factory=dict)
    updates: int = 0
    updates_per_s: float = 0.0
    replay_size: int = 0
    shard_sizes: dict[int, int] = field(default_factory=dict)  # the fillers' latest, by shard
    returns: deque[float] = field(default_factory=lambda: deque(maxlen=50))
    episodes: int = 0
    eval_return: float | None = None
    best_eval: float | None = None
    evals: int = 0
    loss: float | None = None
    policy_lag: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def env_steps(self) -> int:
        return min(sum(self.actor_steps.values()), MAX_COUNT)

    @property
    def recent_return(self) -> float | None:
        """Mean return of the last 50 episodes the actors finished (with exploration)."""
        return sum(self.returns) / len(self.returns) if self.returns else None

    def record_eval(self, score: float) -> None:
        """A new evaluation's mean return."""
        self.eval_return = score
        self.best_eval = max(score, self.best_eval if self.best_eval is not None else score)
        self.evals += 1

    def fold(self, msg: dict[str, Any]) -> None:
        """Take one metrics report in. Whoever can write the run's keys can send anything
        the metrics schema admits: a value that is not a finite number (a counter: not a
        whole number from 0 to :data:`MAX_COUNT`) is ignored and logged once, never fatal."""
        role, ident = msg["role"], msg["id"]
        where = f"metrics of {role}.{ident}"
        v, _ = finite_values(msg["values"], where, lists=True)

        def num(key: str, default: float = 0.0) -> float:
            x = v.get(key, default)
            return float(x) if not isinstance(x, list) else default

        def count(key: str, default: int) -> int:
            x = v.get(key, default)
            if isinstance(x, list) or not 0 <= x <= MAX_COUNT:
                warn_once(
                    f"{where}:{key}", "ignoring %s=%s from %s: not a count from 0 to %d",
                    key, reprlib.repr(x), where, MAX_COUNT, kind="bad value", logger=log,
                )  # fmt: skip
                return default
            return int(x)

        def nums(key: str) -> list[float]:
            x = v.get(key, [])
            return [float(i) for i in x] if isinstance(x, list) else []

        if role in ("actor", "worker"):
            _put(self.actor_steps, ident, count("steps", self.actor_steps.get(ident, 0)))
            _put(self.actor_rate, ident, num("steps_per_s"))
            self.returns.extend(nums("episode_returns"))
            self.episodes = min(self.episodes + len(nums("episode_returns")), MAX_COUNT)
        elif role in ("learner", "master"):
            self.updates = count("updates", self.updates)
            self.updates_per_s = num("updates_per_s")
            if "replay_size" in v:
                self.replay_size = count("replay_size", self.replay_size)
            if "loss" in v:
                self.loss = num("loss")
            if "policy_lag" in v:
                self.policy_lag = num("policy_lag")
            for k in ("dropped", "generation", "stale"):
                if k in v:
                    self.extra[k] = num(k)
        elif role == "replay" and "size" in v:  # a filler: its shard's size, the replay's
            shard, size = count("shard", 0), count("size", -1)  # is their sum; -1: not a count
            if size >= 0 and shard < MAX_SHARDS:
                self.shard_sizes[shard] = size
                self.replay_size = min(sum(self.shard_sizes.values()), MAX_COUNT)

    def row(self) -> dict[str, Any]:
        """One row of :data:`COLUMNS`."""
        return {
            "time_s": round(time.monotonic() - self.start, 2),
            "env_steps": self.env_steps,
            "env_steps_per_s": _r(sum(self.actor_rate.values()), 1),
            "updates": self.updates,
            "updates_per_s": _r(self.updates_per_s, 1),
            "replay_size": self.replay_size,
            "episodes": self.episodes,
            "episodic_return": _r(self.recent_return),
            "eval_return": _r(self.eval_return),
            "evals": self.evals,
            "loss": _r(self.loss),
            "policy_lag": _r(self.policy_lag),
        }


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
        path = run_dir / "metrics.csv"
        # a restarted learner appends to its run's metrics (another layout starts afresh)
        header = ",".join(COLUMNS)
        self._file = os.fdopen(open_appending(path), "a+", newline="")  # not through a link
        self._file.seek(0)
        keep = self._file.readline(len(header) + 2).strip() == header
        if not keep:
            self._file.seek(0)
            self._file.truncate()
        self._file.seek(0, os.SEEK_END)
        self._csv = csv.DictWriter(self._file, fieldnames=list(COLUMNS))
        if not keep:
            self._csv.writeheader()
        self._evals = 0
        try:
            self._sinks = open_sinks(run_dir, tracking or Tracking(), run, config)
        except BaseException:
            self._file.close()
            raise

    def write(self, progress: Progress, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.every
        row = progress.row()
        self._csv.writerow(row)
        self._file.flush()
        scalars = {t: row[c] for c, t in COLUMNS.items() if t is not None and row[c] is not None}
        if row["evals"] == self._evals:
            scalars.pop(COLUMNS["eval_return"], None)  # not a new measurement
        self._evals = row["evals"]
        for sink in self._sinks:
            try:
                sink.log(scalars, row["env_steps"])
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
    every: float = 1.0,
    tracking: Tracking | None = None,
    config: dict[str, Any] | None = None,
) -> threading.Thread:
    """Follow the run's metrics stream from its start in a daemon thread (its own Redis
    connection), writing ``run_dir``'s metrics.csv and the sinks of ``tracking`` until
    ``stop``."""

    def loop() -> None:
        client = connect()
        reader = MetricsReader(client, keys, from_start=True)
        progress = Progress()
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
