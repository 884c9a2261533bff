"""Live config changes (``qrl run set``): what may change, versions, two setters at once,
roles taking changes in between steps and riding out whatever else is written there, and a
live ``qrl train impala`` taking a new learning rate within a second. Real redis-server."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import threading
import time

import pytest
import redis

from qrl.algos.impala.config import ImpalaConfig
from qrl.runtime.config import ConfigError
from qrl.runtime.control import StopFlag, request_stop
from qrl.runtime.live import MAX_BYTES, LiveConfig, describe, set_live
from qrl.runtime.metrics import MetricsReader
from qrl.runtime.runs import RunNotFound, create_run
from tests.cli import qrl, role
from tests.helpers import run_reader, wait_until


@pytest.fixture
def run(r, keys):
    create_run(r, keys, "impala", ImpalaConfig())
    return keys


def test_a_change_is_validated_versioned_and_kept_with_the_earlier_ones(r, run):
    state, cfg = set_live(r, run, ImpalaConfig, {"lr": 1e-4})
    assert state.version == 1 and state.values == state.changed == {"lr": 1e-4}
    assert cfg == ImpalaConfig(lr=1e-4)
    state, cfg = set_live(r, run, ImpalaConfig, {"entropy_cost": 0.02, "grad_clip": 5})
    assert state.version == 2 and state.changed == {"entropy_cost": 0.02, "grad_clip": 5.0}
    assert cfg == ImpalaConfig(lr=1e-4, entropy_cost=0.02, grad_clip=5.0)
    shown = describe(r, run)
    assert shown["version"] == 2 and shown["values"] == {**state.changed, "lr": 1e-4}
    assert shown["line"] == "config v2: lr=0.0001, entropy_cost=0.02, grad_clip=5.0"


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        (
            {"lrr": 1e-4},
            "ImpalaConfig: unknown field 'lrr' (did you mean 'lr'? fields that "
            "may change live: inference_wait_ms, grad_clip, lr, entropy_cost, baseline_cost)",
        ),
        ({"hidden": [8]}, "ImpalaConfig: hidden cannot change while the run runs"),
        ({"actors": 4}, "actors cannot change while the run runs"),
        ({"unroll": 5}, "unroll cannot change while the run runs"),
        ({"lr": -1.0}, "ImpalaConfig: lr=-1.0: Input should be greater than 0"),
        ({"lr": 2.0}, "lr=2.0: Input should be less than or equal to 1"),
        ({"lr": "fast"}, "lr='fast': Input should be a valid number"),
        ({}, "no change given"),
    ],
)
def test_a_refused_change_says_why_in_one_line_and_stores_nothing(r, run, changes, error):
    set_live(r, run, ImpalaConfig, {"lr": 1e-4})
    with pytest.raises(ConfigError, match=re.escape(error)) as refused:
        set_live(r, run, ImpalaConfig, changes)
    assert "\n" not in str(refused.value)
    assert describe(r, run)["version"] == 1 and describe(r, run)["values"] == {"lr": 1e-4}


def test_no_change_to_a_run_that_does_not_exist(r, keys):
    with pytest.raises(RunNotFound):
        set_live(r, keys, ImpalaConfig, {"lr": 1e-4})
    assert not r.exists(keys.config_live)


def test_two_setters_at_once_lose_no_change(redis_server, r, run):
    lrs = [1e-5 * (i + 1) for i in range(40)]
    costs = [1e-3 * (i + 1) for i in range(40)]

    def setter(field: str, values: list[float]) -> None:
        client = redis.Redis.from_url(redis_server.url)
        for v in values:
            set_live(client, run, ImpalaConfig, {field: v})

    threads = [
        threading.Thread(target=setter, args=("lr", lrs)),
        threading.Thread(target=setter, args=("entropy_cost", costs)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    shown = describe(r, run)
    assert shown["values"] == {"lr": lrs[-1], "entropy_cost": costs[-1]}
    assert shown["version"] == 80  # every change its own version


def test_a_role_takes_a_change_in_on_its_stop_poll_and_records_it(r, run, tmp_path):
    record = tmp_path / "config_changes.jsonl"
    live = LiveConfig(r, run, ImpalaConfig(), record)
    stop = StopFlag(r, run, interval=0.0, signals=False, live=live)
    assert not stop() and live.take() is None and live.version == 0
    state, _ = set_live(r, run, ImpalaConfig, {"lr": 1e-4})
    assert not stop()  # the stop poll read the new version
    assert live.take() == ImpalaConfig(lr=1e-4) and live.version == live.applied == 1
    assert live.take() is None  # handed over once
    request_stop(r, run)
    assert stop()  # the same round trip reads the stop flag
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert lines == [
        {"version": 1, "time": state.time, "changed": {"lr": 1e-4}, "values": {"lr": 1e-4}}
    ]


def test_a_role_that_joins_later_starts_with_the_changes_made(r, run):
    set_live(r, run, ImpalaConfig, {"lr": 1e-4})
    set_live(r, run, ImpalaConfig, {"entropy_cost": 0.0})
    live = LiveConfig(r, run, ImpalaConfig())
    assert live.cfg == ImpalaConfig(lr=1e-4, entropy_cost=0.0) and live.version == 2
    assert live.take() is None  # its role is made with live.cfg


def test_a_checkpoint_of_a_changed_run_resumes_at_the_runs_learning_rate(
    redis_server, run, tmp_path
):
    from qrl.learners.base import Learner
    from qrl.runtime.checkpoint import CheckpointError, load_checkpoint
    from tests.helpers import make_learner

    def learner(cfg: ImpalaConfig) -> Learner:
        return make_learner(redis_server.url, run, cfg, checkpoint=tmp_path / "c.pt")

    learner(ImpalaConfig(lr=1e-4, grad_clip=1.0)).save()  # written after `qrl run set`
    with pytest.raises(CheckpointError, match=re.escape("differs in ['unroll']")):
        load_checkpoint(tmp_path / "c.pt", "impala", ImpalaConfig(unroll=5))
    resumed = learner(ImpalaConfig())  # live fields may differ: the run's values win
    assert resumed.opt.param_groups[0]["lr"] == 2e-3  # not the optimizer state's 1e-4
    resumed.reconfigure(ImpalaConfig(lr=3e-4))
    assert resumed.metrics()["lr"] == 3e-4 and resumed.cfg.lr == 3e-4


def _state(version: object, values: object, changed: object = "{}", t: object = "1.0") -> dict:
    return {"version": version, "values": values, "changed": changed, "time": t}


HOSTILE = {
    "a string": lambda r, k: r.set(k, "lr=0.5"),
    "a list": lambda r, k: r.rpush(k, "lr", "0.5"),
    "huge values": lambda r, k: r.hset(k, mapping=_state(3, "{" + " " * MAX_BYTES + "}")),
    "huge changed": lambda r, k: r.hset(k, mapping=_state(3, "{}", "[" * (MAX_BYTES + 1))),
    "huge version": lambda r, k: r.hset(k, mapping=_state("9" * 1_000_000, '{"lr": 0.5}')),
    "bad JSON": lambda r, k: r.hset(k, mapping=_state(3, "{lr: 0.5")),
    "not UTF-8": lambda r, k: r.hset(k, mapping=_state(3, b"\xff\xfe\xfd{")),
    "deep JSON": lambda r, k: r.hset(k, mapping=_state(3, "[" * 30_000 + "]" * 30_000)),
    "values not an object": lambda r, k: r.hset(k, mapping=_state(3, "[0.5]")),
    "unknown field": lambda r, k: r.hset(k, mapping=_state(3, '{"lrr": 0.5}')),
    "field that is not live": lambda r, k: r.hset(k, mapping=_state(3, '{"hidden": [8]}')),
    "value out of bounds": lambda r, k: r.hset(k, mapping=_state(3, '{"lr": 5.0}')),
    "value of the wrong type": lambda r, k: r.hset(k, mapping=_state(3, '{"lr": "0.5"}')),
    "version not a number": lambda r, k: r.hset(k, mapping=_state("three", '{"lr": 0.5}')),
    "version zero": lambda r, k: r.hset(k, mapping=_state(0, '{"lr": 0.5}')),
    "version past 2**53": lambda r, k: r.hset(k, mapping=_state(2**53, '{"lr": 0.5}')),
    "time not a number": lambda r, k: r.hset(k, mapping=_state(3, '{"lr": 0.5}', t="nan")),
    "no version": lambda r, k: r.hset(k, mapping={"values": '{"lr": 0.5}'}),
    "version going back": lambda r, k: r.hset(k, mapping=_state(1, '{"lr": 0.5}')),
}


@pytest.mark.parametrize("write", HOSTILE.values(), ids=HOSTILE)
def test_a_role_keeps_its_config_whatever_is_written_and_warns_once(r, run, write, caplog):
    set_live(r, run, ImpalaConfig, {"lr": 1e-4})
    set_live(r, run, ImpalaConfig, {"entropy_cost": 0.02})
    live = LiveConfig(r, run, ImpalaConfig())
    stop = StopFlag(r, run, interval=0.0, signals=False, live=live)
    kept = ImpalaConfig(lr=1e-4, entropy_cost=0.02)
    assert live.cfg == kept and live.version == 2
    r.delete(run.config_live)
    write(r, run.config_live)
    with caplog.at_level(logging.WARNING, "qrl.runtime.live"):
        for _ in range(3):
            assert not stop()  # the role goes on
    assert live.take() is None and live.cfg == kept and live.version == 2
    refusals = [m for m in caplog.messages if "refused" in m]
    assert len(refusals) == 1, caplog.messages
    # whatever was written, the next change lands above what the role took in, and is taken
    # (the changes the written state lost, entropy_cost's, are lost: the setter says so)
    set_live(r, run, ImpalaConfig, {"lr": 3e-4}, floor=live.version)
    assert not stop()
    assert live.take() == ImpalaConfig(lr=3e-4) and live.version >= 3


def _learner_reports(reader: MetricsReader, until, timeout: float, what: str) -> dict:
    """The first learner report (from ``reader`` on) that ``until`` accepts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for msg in reader.read(block_ms=200):
            if msg["role"] == "learner" and until(msg["values"]):
                return msg
    raise AssertionError(f"no learner report {what} within {timeout:.0f}s")


@pytest.mark.slow
def test_qrl_run_set_changes_a_live_impala_learners_lr(r, redis_server, keys, tmp_path):
    run_dir = tmp_path / "run"
    job = role(
        "train",
        "impala",
        "--redis",
        redis_server.url,
        "--run",
        keys.run,
        "--run-dir",
        str(run_dir),
        "--max-time",
        "300",
        "--target-return",
        "1e9",
        "--eval-every",
        "1000",
        "--set",
        "actors=1",
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        reader = run_reader(r, keys)
        _learner_reports(reader, lambda v: v["updates"] > 0, 180, "with updates")
        out = qrl("run", "set", keys.run, "lr=1e-4")
        assert out.returncode == 0, out.stderr
        written = describe(r, keys)["time"]  # when `qrl run set` wrote it (its clock: ours)
        assert out.stdout.strip() == f"run {keys.run}: config v1: lr=0.0001"
        msg = _learner_reports(reader, lambda v: v["lr"] == 1e-4, 10, "at lr 1e-4")
        # the learner took it in between steps, as config v1, after `qrl run set` wrote it
        # (how soon is a measurement, not a promise a loaded machine can keep)
        assert msg["values"]["config_version"] == 1 and msg["time"] > written

        status = json.loads(qrl("status", "--run", keys.run, "--json").stdout)
        assert status["live_config"]["line"] == "config v1: lr=0.0001"
        assert "config v1: lr=0.0001" in qrl("status", "--run", keys.run).stdout

        refused = qrl("run", "set", keys.run, "hidden=8")
        assert refused.returncode == 2 and "hidden cannot change while the run runs" in (
            refused.stderr
        )
        # the stored changes gone: the next version still goes above what the roles run
        r.delete(keys.config_live)
        again = qrl("run", "set", keys.run, "lr=5e-5")
        assert again.stdout.strip() == f"run {keys.run}: config v2: lr=5e-05", again.stderr
        _learner_reports(reader, lambda v: v["lr"] == 5e-5, 10, "at lr 5e-5")
        changes = run_dir / "config_changes.jsonl"  # the job's stop poll records each change
        wait_until(
            lambda: changes.exists() and len(changes.read_text().splitlines()),
            "the job to record both changes",
            30,
            until=lambda n: n == 2,
        )
    finally:
        request_stop(r, keys)
        job.wait(60)
    lines = [
        json.loads(line) for line in (run_dir / "config_changes.jsonl").read_text().splitlines()
    ]
    assert [(c["version"], c["changed"]) for c in lines] == [(1, {"lr": 1e-4}), (2, {"lr": 5e-5})]
    assert "Traceback" not in (run_dir / "logs" / "learner0.log").read_text()  # of a pool


@pytest.mark.slow
def test_qrl_run_set_refuses_a_run_that_does_not_exist_and_bad_pairs(r, run):
    missing = qrl("run", "set", "no-such-run", "lr=1e-4")
    assert missing.returncode == 1 and "no run 'no-such-run'" in missing.stderr
    bad = qrl("run", "set", run.run, "lr")
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr
    assert qrl("run", "set", run.run).returncode == 2  # no pair at all: usage
    assert not r.exists(run.config_live)
