"""Redis going away under a running job: roles log one line, retry with backoff and carry on
when it comes back (append-only persistence keeps the run); gone past the deadline, they
exit with code 3 and a clear message instead of hanging. Real processes, real redis-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import redis

from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys
from tests.cli import qrl, role
from tests.helpers import fill_replay, wait_until

ROLES = {  # the Ape-X job, as hand-started roles
    "replay": ["replay"],
    "learner": ["learner", "apex"],
    "actor": ["actor", "apex", "--max-steps", "10000000"],
}


def _start(argv: list[str], url: str, run: str, deadline: float, log) -> subprocess.Popen:
    env = {**os.environ, "QRL_REDIS_URL": url, "QRL_RUN": run, "QRL_REDIS_DEADLINE": str(deadline)}
    return role(*argv, env=env, stdout=log, stderr=log)


def _version(url: str, keys: RunKeys) -> int:
    v = redis.Redis.from_url(url).hget(keys.weights, "version")
    return int(v) if v is not None else -1


def _wait_version(url: str, keys: RunKeys, above: int, timeout: float) -> int:
    what = f"weights above version {above}"
    return wait_until(lambda: _version(url, keys), what, timeout, until=lambda v: v > above)


def _job(tmp_path, deadline: float):
    server = EmbeddedRedis(data_dir=tmp_path / "redis", appendonly=True).start()
    keys = RunKeys("faults")
    env = {"QRL_REDIS_URL": server.url}
    created = qrl(
        "run",
        "create",
        "apex",
        "--run",
        keys.run,
        "--set",
        "actors=1",
        "--set",
        "learning_starts=200",
        env={**os.environ, **env},
    )
    assert created.returncode == 0, created.stderr
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ROLES}
    procs = {n: _start(a, server.url, keys.run, deadline, logs[n]) for n, a in ROLES.items()}
    return server, keys, procs, logs


def _stop_all(procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            codes[name] = p.wait()
    return codes


def _noticed(log: Path) -> None:
    """Wait until the process logging to ``log`` says Redis is not answering."""
    wait_until(lambda: "not answering" in log.read_text(), f"{log.name}: Redis gone", 60)


def _signal_redis_gone(proc, server, sig, log: Path, then=None) -> int | None:
    """Stop ``server``, let ``proc`` find Redis gone (its ``log`` says so; then ``then()``),
    send it ``sig``: its exit code, None if it still runs 30 s later (well before the 60 s
    Redis deadline)."""
    server.stop()
    _noticed(log)  # its once-a-second work now waits for Redis
    if then is not None:
        then()
    proc.send_signal(sig)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        return None


def _end(proc: subprocess.Popen, server) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    server.stop()


@pytest.mark.slow
def test_roles_ride_out_a_redis_restart(tmp_path):
    server, keys, procs, logs = _job(tmp_path, deadline=60)
    try:
        before = _wait_version(server.url, keys, 50, timeout=120)
        server.stop()  # SIGTERM: redis-server flushes its append-only file and exits
        for name in ROLES:
            _noticed(tmp_path / f"{name}.log")
        assert all(p.poll() is None for p in procs.values()), "a role died while Redis was away"
        server.start()  # same port, same directory: the run is all there
        assert _version(server.url, keys) >= before  # persisted, not lost
        after = _wait_version(server.url, keys, before + 50, timeout=120)  # and it goes on
        assert after > before + 50
        codes = _stop_all(procs)
        assert codes == {n: 0 for n in ROLES}, codes
    finally:
        _stop_all(procs)
        server.stop()
        for f in logs.values():
            f.close()
    for name in ROLES:
        text = (tmp_path / f"{name}.log").read_text()
        lost = text.count("not answering")
        back = text.count("is back after")
        # one line when Redis goes and one when it is back, per process (the learner also
        # runs a sampler process, which has its own connection)
        most = 2 if name == "learner" else 1
        assert 1 <= lost <= most and 1 <= back <= most, f"{name}:\n{text[-3000:]}"
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"


@pytest.mark.slow
def test_roles_give_up_with_a_clear_message_after_the_deadline(tmp_path):
    server, keys, procs, logs = _job(tmp_path, deadline=3)
    try:
        _wait_version(server.url, keys, 5, timeout=120)
        server.stop()
        codes = {}
        for name, p in procs.items():
            codes[name] = p.wait(60)  # nobody hangs: each gives up, saying why (below)
    finally:
        _stop_all(procs)
        server.stop()
        for f in logs.values():
            f.close()
    for name in ROLES:
        text = (tmp_path / f"{name}.log").read_text()
        assert codes[name] == 3, f"{name} exited {codes[name]}:\n{text[-3000:]}"
        assert "has not answered for 3s" in text, f"{name}:\n{text[-3000:]}"


@pytest.mark.slow
def test_a_learner_stopped_while_redis_is_away_writes_its_final_checkpoint(tmp_path):
    from qrl.algos.apex.config import ApexConfig
    from qrl.replay.role import make_replay
    from qrl.runtime.checkpoint import load_checkpoint
    from qrl.runtime.runs import create_run

    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    keys, cfg = RunKeys("final-ckpt"), ApexConfig(learning_starts=100, publish_every=5)
    client = redis.Redis.from_url(server.url)
    create_run(client, keys, "apex", cfg)
    replay = make_replay(client, keys, cfg)
    fill_replay(replay, np.zeros((300, 4), np.float32))
    ckpt = tmp_path / "learner.pt"
    log = (tmp_path / "learner.log").open("w")
    argv = ["learner", "apex", "--checkpoint", str(ckpt)]
    proc = _start(argv, server.url, keys.run, deadline=60, log=log)
    try:
        _wait_version(server.url, keys, 20, timeout=120)
        # the checkpoint deleted once Redis is gone: one found after was written without it
        code = _signal_redis_gone(
            proc,
            server,
            signal.SIGTERM,
            tmp_path / "learner.log",
            lambda: ckpt.unlink(missing_ok=True),
        )
    finally:
        _end(proc, server)
        log.close()
    text = (tmp_path / "learner.log").read_text()
    assert code == 3, f"exit {code}:\n{text[-3000:]}"  # it gave up on Redis, saying so
    assert "is stopping: not waiting for it" in text and "Traceback" not in text, text[-3000:]
    assert load_checkpoint(ckpt, "apex", cfg)["step"] >= 20  # nothing learned was lost


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_qrl_train_stopped_while_its_redis_is_away_ends_at_once(tmp_path):
    """Ctrl-C on `qrl train` whose Redis has gone: it stops its roles and ends within
    seconds, its result written, instead of waiting out the Redis deadline (60 s) on each
    command it had left and ending in a traceback."""
    server = EmbeddedRedis().start()
    run_dir = tmp_path / "run"
    log = (tmp_path / "train.log").open("w")
    env = {k: v for k, v in os.environ.items() if k not in ("QRL_REDIS_URL", "QRL_REDIS_DEADLINE")}
    argv = [
        "train",
        "apex",
        "--env",
        "CartPole-v1",
        "--redis",
        server.url,
        "--max-time",
        "300",
        "--run",
        "stopped",
        "--run-dir",
        str(run_dir),
        "--set",
        "actors=1",
    ]
    proc = role(*argv, env=env, stdout=log, stderr=log)
    try:
        wait_until(lambda: _version(server.url, RunKeys("stopped")) > 5, "weights", 120)
        code = _signal_redis_gone(proc, server, signal.SIGINT, tmp_path / "train.log")
    finally:
        _end(proc, server)
        log.close()
    text = (tmp_path / "train.log").read_text()
    assert code == 2, f"exit {code}:\n{text[-3000:]}"  # None: still running after 30 s
    assert "Traceback" not in text, text[-3000:]
    assert json.loads((run_dir / "result.json").read_text())["exit_code"] == 2


def test_a_relative_data_dir_keeps_the_append_only_file_there(tmp_path, monkeypatch):
    """`qrl redis --appendonly --dir qrl-redis` (a relative folder, as docs/many-machines.md
    writes it): redis-server changes into --dir, so a relative path given to it twice would
    miss."""
    monkeypatch.chdir(tmp_path)
    server = EmbeddedRedis(data_dir="qrl-redis", appendonly=True).start()
    try:
        redis.Redis.from_url(server.url).set("k", "v")
    finally:
        server.stop()
    assert (tmp_path / "qrl-redis" / "redis.log").exists()
    assert any((tmp_path / "qrl-redis").rglob("*.aof")), list((tmp_path / "qrl-redis").rglob("*"))
