"""Metrics reports and heartbeats from a hostile writer: anything the schemas admit (NaN,
inf, huge or negative counters, strings and lists where numbers belong, a host name that
looks like rich markup) neither crashes what ``qrl train`` does with the metrics nor
``qrl status``; bad values are skipped or shown as '?'. Real Redis, the real CLI."""

from __future__ import annotations

import json
import logging
import math
import time

from qrl.algos import ALGOS
from qrl.runtime.metrics import MetricsReader, report
from qrl.runtime.runlog import Progress, RunLog
from qrl.runtime.runs import create_run
from qrl.wire.codec import encode
from qrl.wire.streams import FIELD
from tests.cli import qrl

INF, NAN = float("inf"), float("nan")

# values a metrics report may carry (numbers or lists of numbers) that are not sane
HOSTILE_METRICS = [
    ("actor", 0, {"steps": NAN, "steps_per_s": INF, "episode_returns": [1.0, NAN, -INF]}),
    ("actor", 1, {"steps": 1e300, "steps_per_s": -INF, "episode_returns": [INF]}),
    ("actor", 2, {"steps": -5, "episode_returns": [NAN, NAN]}),
    ("learner", 0, {"updates": INF, "updates_per_s": NAN, "loss": NAN, "policy_lag": -INF}),
    ("learner", 0, {"updates": -(2**63), "replay_size": 1e200, "dropped": NAN, "stale": INF}),
    ("master", 0, {"updates": [1, 2], "generation": NAN, "loss": [NAN]}),
    ("replay", 0, {"size": NAN}),
    ("replay", 0, {"size": 2**64 - 1}),
]


# the processes that report here (the runs' reporters)
SOURCES = [("actor", 0), ("actor", 1), ("learner", 0)] + [(r, i) for r, i, _ in HOSTILE_METRICS]


def _hostile_reports(r, keys) -> None:
    for role, ident, values in HOSTILE_METRICS:
        payload = encode("metrics", {"time": 1.0, "values": values})
        r.xadd(keys.metrics(role, ident), {FIELD: payload})


def test_hostile_metrics_do_not_crash_the_run_log(r, keys, tmp_path, caplog):
    report(r, keys, "actor", 0, steps=100, steps_per_s=50.0, episode_returns=[10.0])
    report(r, keys, "learner", 0, updates=7, updates_per_s=2.0, loss=0.5, replay_size=64)
    _hostile_reports(r, keys)
    _hostile_reports(r, keys)  # twice: each bad value is logged once
    report(r, keys, "actor", 1, steps=30, steps_per_s=10.0, episode_returns=[20.0])
    reader = MetricsReader(r, keys, SOURCES, from_start=True)
    progress = Progress({**ALGOS["es"].reports, **ALGOS["apex"].reports})  # every role named
    with caplog.at_level(logging.WARNING), RunLog(tmp_path) as out:  # as `qrl train` does
        msgs = reader.read()
        assert len(msgs) == 3 + 2 * len(HOSTILE_METRICS)  # all decode: the schema admits them
        for msg in msgs:
            progress.fold(msg)
            assert out.write(progress, force=True)
    row = progress.row()
    # the sane reports counted, the bad values skipped (the last good value kept)
    assert row["env_steps"] == 130 and row["updates"] == 7 and row["replay_size"] == 64
    assert row["episodes"] == 2 and row["episodic_return"] == 15.0
    assert row["loss"] == 0.5
    for value in row.values():
        assert value is None or math.isfinite(value), row
    warnings = [rec.getMessage() for rec in caplog.records if "ignoring" in rec.getMessage()]
    assert warnings and len(warnings) == len(set(warnings))  # each logged once
    assert any("steps=nan from metrics of actor.0" in w for w in warnings), warnings
    csv = (tmp_path / "metrics.csv").read_text()
    assert "nan" not in csv.lower() and "inf" not in csv.lower()


def _heartbeat(r, keys, name: str, host: str, values: dict, started: float = 0.0) -> None:
    now = time.time()
    hb = {
        "role": "actor",
        "id": 9,
        "host": host,
        "pid": 1,
        "started": started or now - 5,
        "time": now,
        "values": values,
    }
    r.set(keys.proc(name), encode("heartbeat", hb), ex=60)


def test_hostile_heartbeats_do_not_crash_qrl_status(r, keys):
    from qrl.algos.apex.config import ApexConfig

    create_run(r, keys, "apex", ApexConfig())
    report(r, keys, "learner", 0, updates=5, updates_per_s=1.5)  # one honest process
    _heartbeat(
        r,
        keys,
        "a",
        "[/bold]evil[red]",
        {"steps": "many", "steps_per_s": NAN, "version": [1], "inserted": {"x": 1}},
    )
    _heartbeat(r, keys, "b", "host", {"steps": INF, "steps_per_s": 3.0, "version": "new"})
    _heartbeat(r, keys, "c", "host", {"steps": 1}, started=NAN)  # rejected by the schema
    r.hset(keys.weights, "version", "garbage")

    out = qrl("status", "--run", keys.run, "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout, parse_constant=_not_json)  # no NaN or Infinity in it
    procs = {p["host"]: p for p in st["processes"]}
    assert set(procs) >= {"[/bold]evil[red]", "host"} and len(st["processes"]) == 3
    evil = procs["[/bold]evil[red]"]
    assert evil["values"] == {} and sorted(evil["bad"]) == sorted(
        ["steps", "steps_per_s", "version", "inserted"]
    )
    assert procs["host"]["values"] == {"steps_per_s": 3.0}
    assert st["throughput"] == {"learner": 1.5, "actor": 3.0}
    assert st["weights_version"] == -1 and st["policy_lag"] is None

    text = qrl("status", "--run", keys.run, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "Traceback" not in text.stderr
    assert "[/bold]evil[red]:1" in text.stdout  # shown as written, not as markup
    assert "steps ?" in text.stdout and "?" in text.stdout


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} in qrl status --json")


def test_warnings_about_many_distinct_bad_values_stay_bounded(caplog, monkeypatch):
    """Hostile metrics may carry any number of ids and value names, each bad value warned
    about once: what is remembered (and logged) is bounded, not one entry per name."""
    from qrl.runtime import status
    from qrl.wire import faults

    monkeypatch.setattr(faults, "_warned", {})  # the other tests' warnings still logged
    with caplog.at_level(logging.WARNING, logger="qrl"):
        for i in range(100_000):
            status.finite_values({f"name{i}": math.nan}, f"metrics of actor.{i}")
        faults.warn_once("a sink failed")  # another kind: still logged
    assert sum(map(len, faults._warned.values())) <= faults.MAX_WARNED + 2
    assert len(caplog.records) <= faults.MAX_WARNED + 2
    assert "no more" in caplog.records[-2].getMessage()
    assert caplog.records[-1].getMessage() == "a sink failed"
