"""Keys of a run holding the wrong Redis type (anyone with the run's keys can SET, HSET or
LPUSH any of them): no command prints a traceback. The run's config is its identity, so a
config nobody can read is a one-line error naming the key, never repaired; every other key a
role reads is repaired and the role goes on. Real redis-server, the real CLI."""

from __future__ import annotations

import time

import pytest

from qrl.algos import ALGOS
from qrl.algos.apex.config import ApexConfig
from qrl.algos.es.keys import es_params, es_results
from qrl.algos.impala.keys import trajectories
from qrl.algos.ppo.keys import rollouts
from qrl.runtime.config import parse_config
from qrl.runtime.runs import create_run
from tests.cli import qrl, role
from tests.helpers import kill_all, wait_until

WRONG = {  # a write of each Redis type over whatever the key held (on a MULTI pipeline)
    "string": lambda p, key: p.set(key, "x"),
    "hash": lambda p, key: p.delete(key).hset(key, "a", "b"),
    "list": lambda p, key: p.delete(key).lpush(key, "x"),
}
WRITES = {**WRONG, "garbage": lambda p, key: p.set(key, "not a run config")}


def _spoil(r, write: str, *targets: str) -> None:
    """Make ``targets`` hold the wrong type at once (a role must not re-make one between
    the DEL and the write)."""
    pipe = r.pipeline()
    for key in targets:
        WRITES[write](pipe, key)
    pipe.execute()


@pytest.mark.parametrize("write", ["garbage", "hash", "list"])  # a plain "x" is garbage too
@pytest.mark.parametrize(
    "command", [("actor", "apex"), ("learner", "impala"), ("replay",), ("run", "create", "apex")]
)
def test_an_unreadable_run_config_is_a_one_line_error_and_kept(r, keys, command, write):
    _spoil(r, write, keys.config)
    kind = r.type(keys.config)
    out = qrl(*command, "--run", keys.run, timeout=60)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert keys.config in out.stderr and "not readable" in out.stderr, out.stderr
    assert r.type(keys.config) == kind, "the run's config was changed"


def test_run_create_repairs_a_control_key_of_the_wrong_type(r, keys):
    r.set(keys.control, "x")
    out = qrl("run", "create", "apex", "--run", keys.run, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert r.type(keys.control) in (b"none", b"hash")
    create_run(r, keys, "apex", parse_config(ApexConfig, {}))  # it made the run


ROLES = {  # one process of each role of a run
    "apex": [("replay",), ("learner", "apex"), ("actor", "apex")],
    "impala": [("learner", "impala"), ("actor", "impala")],
    "ppo": [("learner", "ppo"), ("actor", "ppo")],
    "es": [("es", "master"), ("es", "worker")],
}


def _role_keys(keys, algo: str) -> list[str]:
    """The run's keys a role of ``algo`` reads or writes, the config, leases and
    heartbeats aside."""
    own = {
        "apex": [
            keys.experience,
            keys.replay_priorities,
            keys.replay_data,
            keys.replay_meta,
            keys.replay_batches,
        ],
        "impala": [trajectories(keys)],
        "ppo": [rollouts(keys)],
        "es": [es_params(keys), es_results(keys)],
    }
    metrics = [keys.metrics(r.name, 0) for r in ALGOS[algo].roles]  # each process's
    return [keys.control, keys.stats, *metrics, keys.deadletter, keys.weights, *own[algo]]


def _no_traceback(out) -> None:
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]


def _spoil_each(r, shift: int, targets: list[str]) -> None:
    """Key ``i`` of ``targets`` made the ``i + shift``-th wrong type: the shifts 0, 1, 2 give
    every key every type."""
    order = sorted(WRONG)
    for i, key in enumerate(targets):
        _spoil(r, order[(i + shift) % len(order)], key)


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(ROLES))
def test_roles_and_commands_ride_out_keys_of_the_wrong_type(r, keys, tmp_path, algo):
    """Every key a role reads made a wrong type before the roles start and twice more while
    they run (each key each type once): each role repairs it and runs on until ``qrl run
    stop``; ``qrl status``, ``qrl run list``, ``stop`` and ``delete`` answer without a
    traceback."""
    create_run(r, keys, algo, ALGOS[algo].config())
    targets = _role_keys(keys, algo)
    _spoil_each(r, 0, targets)
    logs = [tmp_path / f"{i}.log" for i in range(len(ROLES[algo]))]
    procs = [
        role(*command, "--run", keys.run, stderr=log.open("w"))
        for command, log in zip(ROLES[algo], logs, strict=True)
    ]

    def running() -> int:
        """How many of them run (by their heartbeats); fails if one exited."""
        dead = [
            g.read_text()[-3000:] for p, g in zip(procs, logs, strict=True) if p.poll() is not None
        ]
        assert not dead, dead
        return len(list(r.scan_iter(keys.procs_pattern())))

    try:
        wait_until(running, "all of them to run", until=lambda n: n >= len(procs))
        for shift in (1, 2):  # while they run (the control key too)
            _spoil_each(r, shift, targets)
            _no_traceback(qrl("status", "--run", keys.run, timeout=60))
            _no_traceback(qrl("run", "list", timeout=60))
            # an absence (none exits on the keys) shows only as time passes: nothing to wait
            # on (not a heartbeat either: an actor held by the rate limit sends none)
            time.sleep(1.5)
            assert running() >= len(procs)
        _spoil(r, "string", keys.control)  # just before ``run stop`` writes it
        _no_traceback(qrl("run", "stop", "--run", keys.run, timeout=60))
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        kill_all(procs)
    for command, log, code in zip(ROLES[algo], logs, codes, strict=True):
        text = log.read_text()
        assert code == 0 and "Traceback" not in text, (command, code, text[-3000:])
    _no_traceback(qrl("run", "delete", keys.run, "--yes", timeout=60))


@pytest.mark.slow
def test_qrl_train_over_an_unreadable_run_config_is_a_one_line_error(
    r, keys, redis_server, tmp_path
):
    _spoil(r, "hash", keys.config)
    run = ["--redis", redis_server.url, "--run", keys.run, "--run-dir", str(tmp_path / "run")]
    out = qrl("train", "es", "--max-time", "1", *run, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert keys.config in out.stderr and "not readable" in out.stderr, out.stderr
    assert r.type(keys.config) == b"hash"
