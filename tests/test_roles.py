"""Roles declare what they need and report (:class:`qrl.runtime.algorithm.RoleDef`), and the
generic code reads only that: a throwaway algorithm with roles of kinds qrl's own lack
(:mod:`tests._random_algo`: random players, and an oracle, a torch service with ``--device``
that is not a learner) gets its commands and options, its whole ``qrl train`` job, its
``qrl status`` lines, its ``metrics.csv`` column and its ACL users without an edit to the
CLI, ``qrl train``, the launcher, ``qrl status`` or the run log. Real redis-server, real
processes: the algorithm is put in the registry of the ``qrl`` command line it runs."""

from __future__ import annotations

import csv
import fnmatch
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import redis

from qrl.algos import ALGOS
from qrl.jobs.acl import create_users, role_access, user_name
from qrl.runtime.control import request_stop
from qrl.runtime.roles import COLUMNS
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys
from tests._random_algo import ALGORITHM, NAME, RandomConfig, RandomPlayer
from tests.cli import ROOT, qrl_of
from tests.helpers import redis7, wait_until


def _cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``qrl ARGS`` with the throwaway algorithm in its registry."""
    return qrl_of("tests._random_algo", *args, **kw)


def _popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests._random_algo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _options(*command: str) -> set[str]:
    out = _cli(*command, "--help", timeout=60)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"^\s+(?:-\w, )?(--[\w-]+)", out.stdout, re.M))


def _status_until(run: str, ok: Callable[[dict], bool], timeout: float = 60) -> dict:
    def status() -> dict | str:
        out = _cli("status", "--run", run, "--json", timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else out.stderr

    return wait_until(
        status,
        "qrl status to show it",
        timeout,
        until=lambda st: isinstance(st, dict) and ok(st),
        every=0.5,
    )


def _values(st: dict, role: str) -> list[dict]:
    return [p["values"] for p in st["processes"] if p["role"] == role and not p["stale"]]


def test_each_role_gets_the_options_it_declares():
    oracle = _options("oracle")
    assert {"--device", "--threads"} <= oracle  # a torch role that is not a learner
    assert not oracle & {"--id", "--max-steps", "--max-updates", "--checkpoint", "--run-dir"}
    player = _options("actor", NAME)
    assert {"--id", "--max-steps"} <= player  # several processes, a limit on its counter
    assert not player & {"--device", "--threads", "--checkpoint", "--run-dir", "--track"}
    train = _options("train", NAME)
    assert {"--device", "--players"} <= train


def test_the_device_option_reaches_the_service(r, keys):
    import torch

    assert _cli("run", "create", NAME, "--run", keys.run, timeout=60).returncode == 0
    oracle = _popen("oracle", "--run", keys.run, "--device", "cuda")
    try:
        if not torch.cuda.is_available():
            _, err = oracle.communicate(timeout=120)
            assert oracle.returncode == 1 and "no CUDA device" in err, err[-2000:]
            return
        st = _status_until(keys.run, lambda s: [v.get("on_cuda") for v in _values(s, "oracle")])
        assert [v["on_cuda"] for v in _values(st, "oracle")] == [1]
    finally:
        request_stop(r, keys)
        oracle.communicate(timeout=60)


@pytest.mark.slow
def test_a_job_of_new_roles_runs_reports_in_status_and_logs_its_metric(
    redis_server, keys, tmp_path
):
    run_dir = tmp_path / "run"
    job = _popen(
        "train",
        NAME,
        "--redis",
        redis_server.url,
        "--run",
        keys.run,
        "--run-dir",
        str(run_dir),
        "--max-time",
        "8",
        "--target-return",
        "1e9",
        "--device",
        "cpu",
    )
    try:
        st = _status_until(
            keys.run,
            lambda s: (
                [v.get("requests", 0) > 0 for v in _values(s, "oracle")] == [True]
                and len(_values(s, "player")) == 2
            ),
        )
        assert {"oracle", "player"} <= set(st["throughput"])  # each role's declared rate
        text = _cli("status", "--run", keys.run, timeout=60)
        assert text.returncode == 0, text.stderr
        (line,) = (x for x in text.stdout.splitlines() if "oracle.0" in x)
        assert re.search(r"requests [\d,]+ on_cuda 0", line), line
        assert re.search(r"player\.\d.*steps [\d,]+", text.stdout), text.stdout
    finally:
        _, err = job.communicate(timeout=120)
    assert job.returncode == 1, err[-3000:]  # the budget ran out (no target reachable)

    with (run_dir / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [c.name for c in COLUMNS] + ["requests"]
    last = rows[-1]
    assert int(last["requests"]) > 0 and int(last["env_steps"]) > 0 and int(last["episodes"]) > 0
    result = json.loads((run_dir / "result.json").read_text())
    assert result["requests"] == int(last["requests"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert "charts/requests" in events.Tags()["scalars"]


def test_a_role_must_report_under_its_declared_name(r, keys, monkeypatch):
    """Its reports are matched to its declaration by name: a role made under another name
    does not start (in a thread: no signal handlers for this process)."""
    from concurrent.futures import ThreadPoolExecutor

    from qrl.jobs.launch import LaunchError, RoleSpec, run_role

    misnamed = replace(ALGORITHM.role("oracle"), make=lambda ctx: RandomPlayer(ctx.cfg, 0))
    monkeypatch.setitem(ALGOS, NAME, replace(ALGORITHM, roles=(misnamed,)))
    create_run(r, keys, NAME, RandomConfig())
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(run_role, RoleSpec(NAME, "oracle", keys.run))
        try:
            with pytest.raises(LaunchError, match="made a role named 'player'"):
                started.result(timeout=30)
        finally:
            request_stop(r, keys)  # a role that did start stops


def test_acl_users_come_from_the_declared_keys(keys, tmp_path):
    with EmbeddedRedis(binary=redis7()) as server:  # --acl needs 7; the session's may be 6
        _users_from_declared_keys(redis.Redis.from_url(server.url), keys, tmp_path)


def _users_from_declared_keys(r: redis.Redis, keys, tmp_path) -> None:
    users = create_users(r, ALGORITHM, keys, tmp_path / "pw")
    assert set(users) == {"oracle", "player"}
    oracle = str(r.acl_getuser(user_name(keys.run, "oracle"))["keys"])
    player = str(r.acl_getuser(user_name(keys.run, "player"))["keys"])
    assert f"{keys.prefix}oracle:answers" in oracle and f"{keys.prefix}oracle:requests" in oracle
    assert f"{keys.prefix}oracle:requests" in player and "oracle:answers" not in player


@pytest.mark.parametrize("algo", ALGOS)
def test_the_declared_keys_cover_the_algorithms_streams_and_weights(algo):
    """What an algorithm's roles declare is what their ACL users get: every stream its
    status shows is written by one of its roles, and so is every key one of them reads
    (the weights, where they are read; the run's config, its live changes and control flags
    are written by whoever creates, changes and stops the run; the metrics every role reads,
    each process its own)."""
    spec, keys = ALGOS[algo], RunKeys("x")
    access = [role_access(role) for role in spec.roles]
    writes = [p for a in access for p in a.writes]
    streams = [key.split("}:", 1)[1] for key in spec.streams(keys, {"replay_shards": 2}).values()]
    reads = {p for a in access for p in a.reads} - {"config", "config:live", "control"}
    reads.remove("metrics:*")
    assert all(f"metrics:{r.name}.*" in a.writes for r, a in zip(spec.roles, access, strict=True))
    for name in [*streams, *reads]:
        assert any(fnmatch.fnmatchcase(name, p) for p in writes), (name, writes)
