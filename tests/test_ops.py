"""Operating a run from the CLI: ``qrl run create/list/stop/delete``, ``--id auto``,
heartbeats and ``qrl status`` (real processes, real Redis)."""

from __future__ import annotations

import json
import signal
import subprocess
from functools import partial

import pytest

from qrl.runtime.runs import load_run
from tests.cli import qrl, role
from tests.helpers import kill_all, wait_until


def _status(run: str, *extra: str) -> dict:
    out = qrl("status", "--run", run, "--json", *extra, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _wait_status(run: str, pred, *extra: str, timeout: float = 60.0) -> dict:
    """``qrl status --json`` polled until ``pred(status)`` holds."""
    status, what = partial(_status, run, *extra), "a status that satisfies the condition"
    return wait_until(status, what, timeout, until=pred, every=0.3)


@pytest.mark.slow
def test_run_create_from_toml_with_overrides_then_list_stop_delete(r, keys, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('env = "Acrobot-v1"\n[apex]\nlr = 5e-4\nhidden = [32, 32]\nactors = 3\n')
    out = qrl("run", "create", "apex", "--run", keys.run, "--config", str(cfg), "--set", "lr=1e-3")
    assert out.returncode == 0, out.stderr
    algo, config = load_run(r, keys)
    # the [apex] table applies over the top level, --set over both
    assert algo == "apex" and config["env"] == "Acrobot-v1" and config["actors"] == 3
    assert config["lr"] == 1e-3 and config["hidden"] == [32, 32]

    same = qrl("run", "create", "apex", "--run", keys.run, "--config", str(cfg), "--set", "lr=1e-3")
    assert same.returncode == 0 and "identical" in same.stdout
    clash = qrl("run", "create", "apex", "--run", keys.run, "--set", "lr=0.1")
    assert clash.returncode == 1 and "different configuration" in clash.stderr
    bad = qrl("run", "create", "apex", "--run", keys.run, "--set", "nope=1")
    assert bad.returncode == 2 and "KEY one of" in bad.stderr

    shown = qrl("status", "--run", keys.run, "-v")  # -v after the subcommand works too
    assert shown.returncode == 0 and "no weights yet" in shown.stdout and "v-1" not in shown.stdout

    listed = json.loads(qrl("run", "list", "--json").stdout)
    mine = [x for x in listed if x["run"] == keys.run]
    assert len(mine) == 1 and mine[0]["algo"] == "apex" and not mine[0]["stopped"]

    assert qrl("run", "stop", "--run", keys.run).returncode == 0
    assert r.hget(keys.control, "stop") == b"1"
    listed = json.loads(qrl("run", "list", "--json").stdout)
    assert [x["stopped"] for x in listed if x["run"] == keys.run] == [True]

    r.set(keys.weights, b"x")
    other = keys.__class__(keys.run + "-other")
    r.set(other.config, b"keep me")
    # no confirmation (no stdin): nothing is deleted
    refused = qrl("run", "delete", keys.run, input="")
    assert refused.returncode == 1 and r.exists(keys.config)
    gone = qrl("run", "delete", keys.run, "--yes")
    assert gone.returncode == 0 and "3 keys" in gone.stdout
    assert list(r.scan_iter(keys.pattern())) == [] and r.get(other.config) == b"keep me"
    again = qrl("run", "delete", keys.run, "--yes")
    assert again.returncode == 1 and "no run" in again.stderr


def test_bad_config_file_is_a_clear_error(keys, tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("lr = [1, 2\n")
    out = qrl("run", "create", "apex", "--run", keys.run, "--config", str(cfg))
    assert out.returncode == 2 and "bad.toml" in out.stderr
    cfg.write_text('lr = "fast"\n')
    out = qrl("run", "create", "apex", "--run", keys.run, "--config", str(cfg))
    assert out.returncode == 2 and "lr" in out.stderr


@pytest.mark.slow
def test_heartbeats_status_auto_ids_and_stale_processes(r, keys):
    assert qrl("run", "create", "apex", "--run", keys.run).returncode == 0
    # two replay roles with the default --id auto: they get 0 and 1
    procs = [role("replay", "--run", keys.run, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        st = _wait_status(keys.run, lambda s: len(s["processes"]) == 2)
        assert sorted((p["role"], p["id"]) for p in st["processes"]) == [
            ("replay", 0),
            ("replay", 1),
        ]
        assert {p["pid"] for p in st["processes"]} == {p.pid for p in procs}
        assert not any(p["stale"] for p in st["processes"])
        assert st["algo"] == "apex" and st["replay_size"] == 0 and st["dead_letters"] == 0
        assert st["streams"]["experience"]["consumers"] == 2
        assert st["throughput"]["replay"] == 0.0

        # a payload that is not a batch: rejected, dead-lettered, counted in status
        r.xadd(keys.experience, {"d": b"garbage"})
        st = _wait_status(keys.run, lambda s: s["dead_letters"] == 1)
        assert st["rejected"] == 1

        # SIGKILL one: its heartbeat goes stale; SIGTERM the other: it leaves cleanly
        procs[0].kill()
        procs[0].wait(10)
        st = _wait_status(
            keys.run, lambda s: any(p["stale"] for p in s["processes"]), "--stale-after", "3"
        )
        assert [p["pid"] for p in st["processes"] if p["stale"]] == [procs[0].pid]
        assert [p["pid"] for p in st["processes"] if not p["stale"]] == [procs[1].pid]
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(30) == 0, procs[1].stderr.read()[-2000:]
        st = _status(keys.run)
        [dead] = st["processes"]  # only the killed one is left
        assert dead["pid"] == procs[0].pid
        text = qrl("status", "--run", keys.run, "--stale-after", "3")
        assert text.returncode == 0, text.stderr
        row = f"replay.{dead['id']}"
        assert "STALE" in text.stdout and row in text.stdout, text.stdout
    finally:
        kill_all(procs)


@pytest.mark.slow
def test_status_needs_a_run_when_several_exist(keys):
    assert qrl("run", "create", "es", "--run", keys.run).returncode == 0
    assert qrl("run", "create", "es", "--run", keys.run + "-b").returncode == 0
    out = qrl("status")
    assert out.returncode == 2 and keys.run in out.stderr
    missing = qrl("status", "--run", keys.run + "-nope")
    assert missing.returncode == 1 and "no run" in missing.stderr


@pytest.mark.parametrize("bad", ["-1", "x"])
def test_bad_id_is_rejected(keys, bad):
    out = qrl("actor", "apex", "--run", keys.run, "--id", bad)
    assert out.returncode == 2 and "--id" in out.stderr


def test_an_id_past_the_numbers_the_run_follows_is_refused(keys):
    """Numbers go below twice the configured count plus 8, given (``--id``) as claimed:
    the run's metrics readers follow those processes' streams, and no others."""
    assert qrl("run", "create", "apex", "--run", keys.run, "--set", "actors=2").returncode == 0
    out = qrl("actor", "apex", "--run", keys.run, "--id", "12", timeout=120)
    assert out.returncode == 1 and "go from 0 to 11" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_hand_started_master_writes_csv_and_tensorboard_and_qrl_plot_draws_them(keys, tmp_path):
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qrl.runtime.roles import COLUMNS

    run_dir = tmp_path / "run"
    assert qrl("run", "create", "es", "--run", keys.run, "--set", "workers=1").returncode == 0
    master = role(
        "es",
        "master",
        "--run",
        keys.run,
        "--run-dir",
        str(run_dir),
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = role("es", "worker", "--run", keys.run)
    try:
        st = _wait_status(
            keys.run,
            lambda s: s["weights_version"] >= 20 and len(s["processes"]) == 2,
            timeout=90,
        )
        assert {p["role"] for p in st["processes"]} == {"master", "worker"}
        # rates are per report window: on a loaded machine one window may hold no generation
        st = _wait_status(keys.run, lambda s: min(s["throughput"].values(), default=0) > 0)
        assert set(st["throughput"]) == {"master", "worker"}

        def logged() -> int:  # the rows of metrics.csv past generation 20
            if not (run_dir / "metrics.csv").exists():
                return 0
            with (run_dir / "metrics.csv").open() as f:
                updates = [row["updates"] or "" for row in csv.DictReader(f)]
            return sum(u.isdigit() and int(u) >= 20 for u in updates)

        wait_until(logged, "two rows past generation 20", 60, until=lambda n: n >= 2)
    finally:
        for p in (worker, master):
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in (worker, master)]
    assert codes == [0, 0], master.stderr.read()[-2000:]

    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [c.name for c in COLUMNS] and len(rows) >= 3
    steps = [int(r["env_steps"]) for r in rows]
    assert steps == sorted(steps) and steps[-1] > 1000
    assert int(rows[-1]["updates"]) >= 20 and float(rows[-1]["episodic_return"]) > 0
    assert (run_dir / "checkpoint.pt").exists()  # --run-dir implies the checkpoint's place

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"charts/episodic_return", "charts/env_steps_per_s", "charts/updates_per_s"} <= tags
    curve = events.Scalars("charts/episodic_return")
    assert len(curve) >= 2 and curve[-1].step == steps[-1]

    out = qrl("plot", str(run_dir))
    assert out.returncode == 0, out.stderr
    png = (run_dir / "plot.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = qrl("plot", str(empty))
    assert missing.returncode == 1 and "metrics.csv" in missing.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "stop", "--run", "ab\n"],  # a trailing newline is not part of a valid name
        ["status", "--run", "ab\n"],
        ["status", "--run", "a b"],
        ["run", "create", "es", "--run", "ab\n"],
        pytest.param(["train", "es", "--run", "a/b"], marks=pytest.mark.slow),  # 6 s: qrl train
    ],
)
def test_an_invalid_run_name_is_a_one_line_usage_error(argv):
    out = qrl(*argv, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "invalid run name" in out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("Error")] == [
        line for line in out.stderr.splitlines() if "invalid run name" in line
    ]
