"""The small ways hostile data reached the command line's output and the local disk: a
planted symlink beside a checkpoint or a plot, escape sequences and wrong key types in
``qrl status``, a bad run name. Real redis-server, the real CLI."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from qrl.algos.apex.config import ApexConfig
from qrl.runtime.config import parse_config
from qrl.runtime.runs import create_run
from qrl.wire.codec import encode
from tests.cli import qrl

PRECIOUS = "someone else's file\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(PRECIOUS)
    return victim


def test_a_checkpoint_write_does_not_follow_a_planted_symlink(tmp_path):
    import torch

    from qrl.runtime.checkpoint import load_checkpoint, replace_model, save_checkpoint

    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / "checkpoint.pt"
    (run_dir / "checkpoint.pt.tmp").symlink_to(victim)  # where the old code wrote first
    cfg = parse_config(ApexConfig, {})
    model = {"w": torch.zeros(2)}
    save_checkpoint(path, "apex", cfg, model, None, 1)
    replace_model(path, {"w": [1.0, 2.0]}, 2)
    assert victim.read_bytes() == PRECIOUS.encode(), "the symlink's target was overwritten"
    assert not path.is_symlink() and load_checkpoint(path)["step"] == 2
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as any new file, as before
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint.pt", "checkpoint.pt.tmp"]


def test_qrl_plot_does_not_follow_a_planted_symlink(tmp_path):
    from qrl.runtime.plot import plot_run

    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with (run_dir / "metrics.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time_s", "env_steps", "episodic_return", "loss"])
        w.writerows([[1, 100, 10, 0.5], [2, 200, 20, 0.4]])
    (run_dir / "plot.png").symlink_to(victim)
    assert plot_run(run_dir) == run_dir / "plot.png"
    assert victim.read_bytes() == PRECIOUS.encode(), "the symlink's target was overwritten"
    png = run_dir / "plot.png"
    assert not png.is_symlink() and png.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.csv", "plot.png"]


ESC = "\x1b]0;owned\x07\x1b[2J\x1b[31m"  # set the terminal title, clear it, turn it red


def _heartbeat(r, keys, role: str, host: str, values: dict) -> None:
    blob = encode(
        "heartbeat",
        {
            "role": role,
            "id": 0,
            "host": host,
            "pid": 1,
            "started": 0.0,
            "time": 1e12,
            "values": values,
        },
    )
    r.set(keys.proc(f"{role}.0@x:1"), blob, ex=60)


def test_qrl_status_prints_no_control_characters_from_redis(r, keys):
    create_run(r, keys, "apex", parse_config(ApexConfig, {"env": f"CartPole-v1{ESC}"}))
    _heartbeat(r, keys, f"actor{ESC}", f"host{ESC}", {f"steps{ESC}": 5, "steps": 7})
    r.hset(keys.stats, mapping={f"rejected{ESC}": 3, b"\xff\xfe": 1})
    for args in ((), ("--json",)):
        out = qrl("status", "--run", keys.run, *args, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "actor" in out.stdout and "host" in out.stdout, out.stdout
        for c in "\x1b\x07\r\x0c":
            assert c not in out.stdout + out.stderr, (c, out.stdout)
    status = json.loads(out.stdout)
    assert status["env"].startswith("CartPole-v1") and "\\u001b" not in out.stdout


@pytest.mark.slow
def test_qrl_status_shows_what_it_can_and_names_the_keys_of_the_wrong_type(r, keys):
    create_run(r, keys, "apex", parse_config(ApexConfig, {}))
    _heartbeat(r, keys, "actor", "somehost", {"steps": 7})
    r.set(keys.control, "x")
    r.set(keys.stats, "x")
    r.hset(keys.deadletter, "a", "b")
    r.rpush(keys.weights, "x")
    r.hset(keys.experience, "a", "b")
    r.set(keys.replay_priorities, "x")
    out = qrl("status", "--run", keys.run, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "somehost" in out.stdout, out.stdout
    assert "unreadable" in out.stdout
    for name in ("control", "stats", "deadletter", "weights", "experience", "apex status"):
        assert name in out.stdout.split("unreadable", 1)[1], out.stdout
    out = qrl("status", "--run", keys.run, "--json", timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    status = json.loads(out.stdout)
    assert len(status["unreadable"]) >= 6 and status["processes"], status

    r.delete(keys.config)
    r.hset(keys.config, "a", "b")  # the run's config itself of the wrong type
    out = qrl("status", "--run", keys.run, "--json", timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "config" in json.loads(out.stdout)["unreadable"]


@pytest.mark.parametrize("command", [("actor", "apex"), ("learner", "apex"), ("replay",)])
def test_a_role_with_a_bad_run_name_is_a_usage_error(command):
    env = {**os.environ, "QRL_REDIS_URL": "redis://127.0.0.1:1/0"}  # never asked
    out = qrl(*command, "--run", "bad name}", env=env, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--run" in out.stderr and "Traceback" not in out.stderr


def test_qrl_status_finds_the_only_run_whatever_the_type_of_its_keys():
    import redis

    from qrl.server.embedded import EmbeddedRedis
    from qrl.wire.keys import RunKeys

    with EmbeddedRedis() as server:  # its own Redis: the run is the only one
        r = redis.Redis.from_url(server.url)
        keys = RunKeys("only")
        create_run(r, keys, "apex", parse_config(ApexConfig, {}))
        r.set(keys.control, "x")
        out = qrl("status", "--redis", server.url, "--json", timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        status = json.loads(out.stdout)
        assert status["run"] == "only" and status["unreadable"] == ["control"], status
        r.delete(keys.config)
        r.hset(keys.config, "a", "b")
        out = qrl("status", "--redis", server.url, "--json", timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout)["unreadable"] == ["config", "control"]


def test_qrl_run_list_prints_no_control_characters_or_markup_from_redis():
    import redis

    from qrl.server.embedded import EmbeddedRedis
    from qrl.wire.keys import RunKeys

    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        env = f"CartPole-v1[link=https://evil.example]{ESC}"
        create_run(r, RunKeys("listed"), "apex", parse_config(ApexConfig, {"env": env}))
        wide = {**os.environ, "COLUMNS": "300"}  # the whole env id on one line
        out = qrl("run", "list", "--redis", server.url, env=wide, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "listed" in out.stdout and "[link=https://evil.example]" in out.stdout, out.stdout
    for c in "\x1b\x07":
        assert c not in out.stdout, (c, out.stdout)


# a one-second ES job that runs out its budget (ES's first parameters may solve CartPole at
# the first evaluation: no target it can reach)
ONE_SECOND_ES = [
    "es",
    "--max-time",
    "1",
    "--workers",
    "1",
    "--eval-episodes",
    "1",
    "--target-return",
    "1e9",
]


@pytest.mark.slow
def test_qrl_train_does_not_follow_symlinks_planted_in_its_run_dir(tmp_path):
    """Links planted in a run dir where ``qrl train`` writes (its config, result, metrics and
    role logs) are replaced by the files, their targets left alone (a one-second ES job)."""
    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    planted = ["config.json", "result.json", "metrics.csv", "logs/master.log", "logs/worker0.log"]
    for name in planted:
        (run_dir / name).symlink_to(victim)
    env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_URL"}
    proc = qrl("train", *ONE_SECOND_ES, "--run-dir", str(run_dir), timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the budget ran out, nothing failed
    assert victim.read_bytes() == PRECIOUS.encode(), "a symlink's target was written"
    assert not any((run_dir / name).is_symlink() for name in planted)
    assert json.loads((run_dir / "result.json").read_text())["exit_code"] == 1
    assert json.loads((run_dir / "config.json").read_text())["algo"] == "es"
    assert (run_dir / "metrics.csv").read_text().startswith("time_s,")
    assert "master" in (run_dir / "logs" / "master.log").read_text()


@pytest.mark.slow
def test_qrl_train_starts_over_a_control_key_of_the_wrong_type(r, keys, redis_server, tmp_path):
    """Finding 5 for ``qrl train`` itself: a control key someone made a string (in a shared
    Redis, before the run starts) is repaired, not a WRONGTYPE that ends the job."""
    r.set(keys.control, "x")
    run = ["--redis", redis_server.url, "--run", keys.run, "--run-dir", str(tmp_path / "run")]
    proc = qrl("train", *ONE_SECOND_ES, *run, timeout=120)
    assert "WRONGTYPE" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["exit_code"] == 1
    assert r.type(keys.control) in (b"none", b"hash")
