"""A run's results: ``qrl eval`` (run dir or checkpoint, ``--env``, ``--video``), ``qrl
plot`` (evaluations as points, target, loss) and tracking (TensorBoard, W&B offline)."""

from __future__ import annotations

import csv
import json
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from qrl.runtime.tracking import WANDB_MISSING
from tests.cli import ROOT, eval_confirmation, eval_stats, qrl, role, train
from tests.helpers import wait_until


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A short ES run on CartPole, tracked with W&B offline (files under RUN_DIR/wandb)."""
    run_dir = tmp_path_factory.mktemp("results") / "run"
    with pytest.MonkeyPatch.context() as mp:
        for var, value in _wandb_offline(tmp_path_factory.mktemp("wandb-home")).items():
            mp.setenv(var, value)
        result = train(
            "es",
            run_dir,
            "--env",
            "CartPole-v1",
            "--seed",
            "1",
            "--target-return",
            "150",
            "--max-time",
            "90",
            "--track",
            "--wandb-project",
            "qrl-test",
            timeout=240,
        )
    assert result["reached"] and result["target"] == 150
    return run_dir


def _wandb_offline(home: Path) -> dict[str, str]:
    """W&B offline, its own config and cache out of the user's home."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
    }


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _logged_steps(run_dir: Path) -> int:
    """The env steps of metrics.csv's last whole row, 0 before it has one."""
    if not (run_dir / "metrics.csv").exists():
        return 0
    steps = [row["env_steps"] or "" for row in _rows(run_dir)]
    return int(steps[-1]) if steps and steps[-1].isdigit() else 0


def _new_eval_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [
        r for i, r in enumerate(rows) if int(r["evals"]) > int(rows[i - 1]["evals"] if i else 0)
    ]


@pytest.mark.slow
def test_eval_of_a_run_dir_and_of_its_checkpoint_prints_mean_std_min_max(run_dir):
    by_dir = qrl("eval", str(run_dir), "--episodes", "4", timeout=120)
    by_file = qrl("eval", str(run_dir / "checkpoint.pt"), "--episodes", "4", timeout=120)
    assert by_dir.returncode == 0 and by_file.returncode == 0, by_dir.stderr + by_file.stderr
    stats = eval_stats(by_dir.stdout)
    assert stats == eval_stats(by_file.stdout)  # same checkpoint, same seeds
    assert stats["episodes"] == 4 and stats["min"] <= stats["mean"] <= stats["max"] <= 500
    assert stats["std"] >= 0 and stats["mean"] > 50  # random play scores ~22
    assert by_dir.stdout.startswith("CartPole-v1: ")

    not_a_run = qrl("eval", str(run_dir / "logs"))
    assert not_a_run.returncode == 1 and "no checkpoint at" in not_a_run.stderr


@pytest.mark.slow
def test_a_solve_is_confirmed_on_100_fresh_episodes_of_the_checkpointed_weights(run_dir):
    result = json.loads((run_dir / "result.json").read_text())
    assert result["confirm_episodes"] == 100 and result["confirm_return"] >= 150
    # the confirmation played its seeds with the weights the checkpoint keeps: qrl eval on
    # the same seeds sees the same mean
    eval_confirmation(run_dir)
    assert result["eval_return"] >= 150  # the 10-episode evaluation that asked for it


@pytest.mark.slow
def test_eval_on_another_env_checks_its_spaces(run_dir):
    other = qrl("eval", str(run_dir), "--env", "CartPole-v0", "--episodes", "3", timeout=120)
    assert other.returncode == 0, other.stderr
    assert other.stdout.startswith("CartPole-v0: ") and eval_stats(other.stdout)["max"] <= 200
    wrong = qrl("eval", str(run_dir), "--env", "Acrobot-v1", timeout=120)
    assert wrong.returncode == 1
    (line,) = wrong.stderr.strip().splitlines()
    assert "Acrobot-v1 does not fit a policy trained on CartPole-v1" in line and "(6,)" in line


@pytest.mark.slow
def test_eval_video_writes_an_mp4_per_episode(run_dir, tmp_path):
    videos = tmp_path / "videos"
    out = qrl(
        "eval",
        str(run_dir),
        "--env",
        "CartPole-v0",
        "--episodes",
        "2",
        "--video",
        str(videos),
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    files = sorted(videos.glob("*.mp4"))
    assert [f.name for f in files] == ["episode-0-episode-0.mp4", "episode-1-episode-0.mp4"]
    for f in files:
        data = f.read_bytes()
        assert data[4:8] == b"ftyp" and len(data) > 5000  # an MP4 with frames in it

    out = _without("moviepy", "eval", str(run_dir), "--video", str(tmp_path / "none"))
    assert (
        out.returncode == 1
        and out.stderr == "Error: --video needs moviepy: pip install 'qrl-rl[video]'\n"
    )
    assert not (tmp_path / "none").exists()


def test_plot_draws_new_evaluations_as_points_the_target_and_the_loss(tmp_path):
    from qrl.runtime.plot import draw

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # evaluations 1 and 2 arrive at rows 1 and 3; rows 2 and 4 repeat them
    (run_dir / "metrics.csv").write_text(
        "time_s,env_steps,episodic_return,eval_return,evals,loss\n"
        "1,100,10,,0,0.9\n2,200,12,30,1,0.7\n3,300,15,30,1,0.6\n4,400,20,30,2,0.5\n"
        "5,500,25,30,2,0.4\n"
    )
    (run_dir / "result.json").write_text(json.dumps({"target": 475.0}))
    top, middle, *_ = draw(run_dir).axes
    lines = {line.get_label(): line for line in top.lines}
    evals = lines["evaluation"]
    assert evals.get_linestyle() == "None" and evals.get_marker() == "o"  # points, no line
    assert list(evals.get_xdata()) == [200, 400] and list(evals.get_ydata()) == [30, 30]
    assert list(lines["target 475"].get_ydata()) == [475, 475]
    assert list(middle.lines[0].get_ydata()) == [0.9, 0.7, 0.6, 0.5, 0.4]


@pytest.mark.slow
def test_plot_of_a_run_writes_a_png_with_one_point_per_evaluation(run_dir):
    from qrl.runtime.plot import draw

    out = qrl("plot", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert (run_dir / "plot.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    rows = _rows(run_dir)
    new = _new_eval_rows(rows)
    evals = {line.get_label(): line for line in draw(run_dir).axes[0].lines}["evaluation"]
    assert list(evals.get_xdata()) == [float(r["env_steps"]) for r in new]
    assert 1 <= len(new) < len(rows)  # the last row repeats an evaluation, at least


@pytest.mark.slow
def test_tracking_writes_tensorboard_and_an_offline_wandb_run(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = _rows(run_dir)
    new = _new_eval_rows(rows)
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("charts/eval_return")] == [
        int(r["env_steps"]) for r in new
    ]

    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(_wandb_records(wandb_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (
        run.project == "qrl-test"
        and run.display_name == json.loads((run_dir / "config.json").read_text())["run"]
    )
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert len(history) == len(rows), history  # one entry per metrics.csv row
    assert [h["env_steps"] for h in history] == [int(r["env_steps"]) for r in rows]
    assert [h["charts/eval_return"] for h in history if "charts/eval_return" in h] == [
        float(r["eval_return"]) for r in new
    ]


def _wandb_records(path: Path):
    """The records of a W&B run file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


NO_REDIS = "redis://127.0.0.1:1"  # none: these commands must stop before connecting


def _without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``qrl ARGS`` as if ``module`` were not installed."""
    hide = f"import sys; sys.modules[{module!r}] = None; from qrl.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", hide, *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_track_without_wandb_is_one_line_before_anything_starts(tmp_path):
    learner = ["learner", "apex", "--redis", NO_REDIS, "--run", "x"]
    for args in (
        ["train", "es", "--run-dir", str(tmp_path / "run"), "--track"],
        [*learner, "--run-dir", str(tmp_path / "run"), "--track"],
    ):
        out = _without("wandb", *args)
        assert out.returncode == 1, out.stderr
        assert out.stderr.strip() == f"Error: {WANDB_MISSING}"
        assert not (tmp_path / "run").exists()
    no_dir = qrl(*learner, "--track")
    assert no_dir.returncode == 2 and "--track needs --run-dir" in no_dir.stderr


@pytest.mark.slow
def test_hand_started_master_with_track_logs_to_wandb(redis_server, keys, tmp_path, monkeypatch):
    for var, value in _wandb_offline(tmp_path / "home").items():
        monkeypatch.setenv(var, value)
    run_dir = tmp_path / "run"
    assert qrl("run", "create", "es", "--run", keys.run, "--set", "workers=1").returncode == 0
    master = role(
        "es",
        "master",
        "--run",
        keys.run,
        "--run-dir",
        str(run_dir),
        "--track",
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = role("es", "worker", "--run", keys.run, "--max-steps", "5000")
    try:
        assert worker.wait(120) == 0
        # the master's log catches up with the worker's last report
        wait_until(
            lambda: _logged_steps(run_dir),
            "the worker's last report logged",
            60,
            until=lambda steps: steps >= 5000,
        )
    finally:
        master.send_signal(signal.SIGTERM)
        code = master.wait(60)
    assert code == 0, master.stderr.read()[-2000:]
    rows = _rows(run_dir)
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(_wandb_records(wandb_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "qrl" and run.display_name == keys.run
    steps = [
        json.loads(i.value_json)
        for r in records
        if r.WhichOneof("record_type") == "history"
        for i in r.history.item
        if list(i.nested_key) == ["env_steps"]
    ]
    assert steps == [int(r["env_steps"]) for r in rows] and steps[-1] >= 5000
