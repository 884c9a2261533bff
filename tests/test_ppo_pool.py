"""The learner pool (PPO's, and IMPALA's: the machinery is every learner's), real processes on a
real Redis: two learners that meet through Redis alone hold the same parameters after every
update; one SIGKILLed stops the other with a clear message, and the pool started again resumes
from the checkpoint."""

from __future__ import annotations

import re

import pytest
import torch

from tests.cli import qrl
from tests.helpers import Roles, run_reader

pytestmark = pytest.mark.slow

SMALL = (
    "--set",
    "learners=2",
    "--set",
    "actors=1",
    "--set",
    "batch_unrolls=16",
    "--set",
    "envs_per_actor=8",
    "--set",
    "unroll=16",
)
MORE = {"ppo": ("--set", "epochs=2"), "impala": ()}


def _create(keys, algo: str = "ppo") -> None:
    created = qrl("run", "create", algo, "--run", keys.run, *SMALL, *MORE[algo])
    assert created.returncode == 0, created.stderr


def _version(r, keys) -> int:
    v = r.hget(keys.weights, "version")
    return int(v) if v is not None else -1


def _saved_step(ckpt) -> int:
    """The update the checkpoint holds, -1 while there is none (or it is being replaced)."""
    try:
        return int(torch.load(ckpt, weights_only=True)["step"])
    except (OSError, RuntimeError, EOFError, KeyError):
        return -1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algo", ["ppo", "impala"])
def test_two_learners_hold_identical_parameters_after_their_updates(r, keys, tmp_path, algo):
    _create(keys, algo)
    roles = Roles(keys.run, tmp_path)
    try:
        for name in ("learner-a", "learner-b"):
            roles.start(name, "learner", algo, "--max-updates", "12")
        roles.start("actor", "actor", algo)
        for name in ("learner-a", "learner-b"):
            assert roles.procs.pop(name).wait(180) == 0, roles.log(name)[-3000:]
    finally:
        roles.cleanup()
    last = {}
    for m in run_reader(r, keys).read():
        if m["role"] == "learner":
            last[m["id"]] = m["values"]
    assert sorted(last) == [0, 1]
    a, b = last.values()
    assert a["updates"] == b["updates"] == 12
    assert {a["rank"], b["rank"]} == {0.0, 1.0}
    assert a["params_crc"] == b["params_crc"]  # bit-identical parameters
    assert a["allreduce_s"] > 0 and b["allreduce_s"] > 0
    assert _version(r, keys) == 12  # the leader published every update


@pytest.mark.timeout(300)
def test_a_killed_learner_stops_the_other_and_the_pool_resumes_from_the_checkpoint(
    r, keys, tmp_path
):
    _create(keys)
    ckpt = tmp_path / "learner.pt"
    learner = ("learner", "ppo", "--checkpoint", str(ckpt), "--checkpoint-every", "1")
    roles = Roles(keys.run, tmp_path)
    try:
        roles.start("learner-a", *learner)
        roles.start("learner-b", *learner)
        roles.start("actor", "actor", "ppo")
        roles.until(lambda: _version(r, keys), "the pool to train", until=lambda v: v >= 10)
        # a checkpoint of some training (the leader writes one at update 0 a second after
        # its start, then one a second: the pool can pass update 10 in between)
        roles.until(lambda: _saved_step(ckpt), "a checkpoint", until=lambda step: step >= 1)

        roles.kill("learner-b")
        survivor = roles.procs.pop("learner-a")
        assert survivor.wait(60) != 0  # a failure, not a clean stop: the pool is broken
        log = roles.log("learner-a")
        assert "is gone" in log and "restart the learners" in log, log[-3000:]

        saved = _saved_step(ckpt)
        assert saved >= 1
        roles.start("learner-c", *learner)
        roles.start("learner-d", *learner)
        v = _version(r, keys)
        roles.until(
            lambda: _version(r, keys), "training after the restart", until=lambda x: x >= v + 5
        )
        logs = roles.log("learner-c") + roles.log("learner-d")
        assert f"at update {saved}" in logs  # one of them had the checkpoint
        ranks = sorted(re.findall(r"learner rank (\d) of 2", logs))
        assert ranks == ["0", "1"]  # a new pool of two (a new generation)
        assert roles.stop("learner-c", "learner-d", "actor") == {
            "learner-c": 0,
            "learner-d": 0,
            "actor": 0,
        }
    finally:
        roles.cleanup()
