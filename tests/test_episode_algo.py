"""A second throwaway algorithm (:mod:`tests._episode_algo`: REINFORCE on whole episodes, with
a sink and a batch source of its own) is served by qrl's generic parts without an edit to
them: the one ``Actor`` and ``Learner``, the CLI, ``qrl train`` (with ``--acl``: its roles'
declared keys and scripts are all they need; with ``--one-process``: the same seed gives the
same weights), the run dir. Real redis-server, real processes: the algorithm is put in the
registry of the ``qrl`` command line it runs."""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from qrl.runtime.metrics import MetricsReader
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore
from tests._episode_algo import ALGORITHM, KIND, NAME, EpisodeConfig, episode_schema, returns_to_go
from tests.cli import ROOT, qrl_of
from tests.helpers import redis7, weights


def _cli(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    """``qrl ARGS`` with the episode algorithm in its registry."""
    return qrl_of("tests._episode_algo", *args, timeout=240, **kw)


def test_no_generic_module_names_it():
    """The algorithm and its parts live in its test module only."""
    names = (NAME, KIND, "EpisodeSink", "EpisodeSource", "ReinforceRule")
    for path in (ROOT / "qrl").rglob("*"):
        if path.is_file() and path.suffix in (".py", ".lua", ".toml", ".md"):
            text = path.read_text()
            assert not [n for n in names if n in text], path


def test_returns_to_go_discount_what_follows():
    assert returns_to_go(np.ones(3), 0.5).tolist() == [1.75, 1.5, 1.0]


@contextlib.contextmanager
def _redis(acl: bool, session: EmbeddedRedis) -> Iterator[str]:
    """The session's Redis, or with ``acl`` one of version 7 (``--acl`` needs one)."""
    if not acl:
        yield session.url
        return
    with EmbeddedRedis(binary=redis7()) as server:
        yield server.url


@pytest.mark.slow
@pytest.mark.parametrize("acl", [False, True], ids=["plain", "acl"])
def test_it_trains_end_to_end(acl: bool, redis_server, keys: RunKeys, tmp_path: Path):
    """Actors push whole episodes, the learner trains on them and publishes, the actors act
    with what it published; REINFORCE reaches a return of 100 on CartPole in seconds. With
    ``--acl`` every process runs as a user of the keys and scripts its role declares."""
    run_dir = tmp_path / "run"
    with _redis(acl, redis_server) as url:
        out = _cli(
            "train",
            NAME,
            "--env",
            "CartPole-v1",
            "--redis",
            url,
            "--run",
            keys.run,
            "--run-dir",
            str(run_dir),
            "--max-time",
            "60",
            "--target-return",
            "100",
            *(["--acl"] if acl else []),
        )
        assert out.returncode == 0, out.stderr[-3000:]  # reached the target
        r = redis.Redis.from_url(url)
        assert WeightStore(r, keys).version() > 0  # the learner published its updates
        reporters = ALGORITHM.reporters(EpisodeConfig())
        reports = MetricsReader(r, keys, reporters, from_start=True).read()
        actors = [x["values"] for x in reports if x["role"] == "actor"]
        assert max(v["version"] for v in actors) > 0  # the actors loaded them
        assert max(v["sent"] for v in actors) > 0
        assert int(r.hget(keys.stats, "produced:episodes")) > 0  # counted by its producer
        assert r.xlen(keys.deadletter) == 0  # every message as its schema says

    with (run_dir / "metrics.csv").open(newline="") as f:
        last = list(csv.DictReader(f))[-1]
    assert int(last["env_steps"]) > 0 and int(last["updates"]) > 0 and int(last["episodes"]) > 0
    assert float(last["policy_lag"]) >= 0  # the source's measure, in the learner's column
    result = json.loads((run_dir / "result.json").read_text())
    assert result["reached"] and result["confirm_return"] >= 100


def test_a_message_is_checked_against_its_episodes():
    """The schema refuses lengths that do not add up to the steps sent."""
    from qrl.rl.envspec import EnvSpec
    from qrl.wire.codec import CodecError, decode, encode

    cfg = EpisodeConfig()
    schema = episode_schema(cfg, EnvSpec.of("CartPole-v1"))
    msg = {
        "obs": np.zeros((5, 4), np.float32),
        "action": np.zeros(5, np.int32),
        "rtg": np.ones(5, np.float32),
        "lengths": np.array([2, 3], np.int32),
        "version": 0,
        "actor": 0,
        "batch": "b",
    }
    assert decode(encode(KIND, msg), schema)["lengths"].tolist() == [2, 3]
    with pytest.raises(CodecError, match="add up"):
        decode(encode(KIND, {**msg, "lengths": np.array([2, 2], np.int32)}), schema)


@pytest.mark.slow
def test_one_process_gives_the_same_weights_for_the_same_seed(tmp_path: Path):
    """Its roles declare turns (``actor_role``, ``learner_role``): ``--one-process`` runs
    them, and a seed's weights after N updates are the same bit for bit, another's not."""
    got = {}
    for name, seed in (("first", 0), ("again", 0), ("other", 1)):
        run_dir = tmp_path / name
        out = _cli(
            "train",
            NAME,
            "--one-process",
            "--env",
            "CartPole-v1",
            "--seed",
            str(seed),
            "--max-updates",
            "5",
            "--target-return",
            "1e9",
            "--run-dir",
            str(run_dir),
        )
        assert out.returncode == 1, out.stderr[-3000:]  # the budget ran out
        assert json.loads((run_dir / "result.json").read_text())["updates"] == 5
        got[name] = weights(run_dir)
    assert got["first"] == got["again"]
    assert got["first"] != got["other"]
