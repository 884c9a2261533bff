"""Process faults: SIGKILL an actor, the replay role, the learner and an ES worker mid-run,
start each again, and account for every batch: each one an actor added to the experience
stream reaches the replay exactly once (idempotent by batch id), none is lost, and the
learner resumes from its checkpoint at the step it saved. Real processes, real Redis."""

from __future__ import annotations

from operator import not_
from pathlib import Path

import pytest
import torch

from qrl.algos.es.keys import es_params
from qrl.wire.keys import RunKeys
from qrl.wire.streams import GROUP
from tests.cli import qrl
from tests.helpers import Roles, pid_alive

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _int(v) -> int:
    return int(v) if v is not None else -1


@pytest.mark.timeout(400)
def test_sigkill_actor_replay_and_learner_loses_and_duplicates_nothing(r, keys, tmp_path):
    created = qrl(
        "run",
        "create",
        "apex",
        "--run",
        keys.run,
        "--set",
        "actors=2",
        "--set",
        "learning_starts=500",
        "--set",
        "claim_idle_ms=1500",
        "--set",
        "replay_capacity=1000000",
        "--set",
        "actor_batch=64",
    )
    assert created.returncode == 0, created.stderr
    ckpt = tmp_path / "learner.pt"
    learner = ["learner", "apex", "--checkpoint", str(ckpt), "--checkpoint-every", "2"]
    roles = Roles(keys.run, tmp_path)

    def version() -> int:
        return _int(r.hget(keys.weights, "version"))

    def inserted() -> int:
        return _int(r.hget(keys.replay_meta, "inserted"))

    try:
        roles.start("replay-1", "replay")
        roles.start("learner-1", *learner)
        roles.start("actor-a", "actor", "apex")
        roles.start("actor-b", "actor", "apex")
        roles.until(version, "the learner to train", until=lambda x: x >= 30)

        roles.kill("actor-a")  # mid-run: whatever it had not pushed is gone, nothing else
        roles.start("actor-c", "actor", "apex")
        v = version()
        roles.until(version, "training after the actor was killed", until=lambda x: x >= v + 20)

        # the replay role, killed while it holds entries: another claims them (idle 1.5 s)
        roles.kill_holding("replay-1", r, keys.experience)
        roles.start("replay-2", "replay")
        n = inserted()
        roles.until(inserted, "the new replay role to insert", until=lambda x: x > n + 500)

        # the learner: killed, restarted from its checkpoint at the step it saved
        roles.until(ckpt.exists, "a checkpoint")
        children = _children(roles.procs["learner-1"].pid)
        sampler = [c for c in children if "spawn_main" in _cmdline(c)]
        assert len(sampler) == 1  # the learner's sampler process (beside multiprocessing's
        # resource tracker, which spawn starts and which ends with its last user)
        roles.kill("learner-1")
        roles.until(lambda: pid_alive(sampler[0]), "the orphaned sampler to exit", 10, until=not_)
        roles.until(
            lambda: list(filter(pid_alive, children)),
            "every child of the learner to exit",
            until=not_,
        )
        saved = int(torch.load(ckpt, weights_only=True)["step"])
        assert saved > 0
        roles.start("learner-2", *learner)
        v = version()
        roles.until(version, "training after the learner restart", until=lambda x: x >= v + 20)
        assert f"at update {saved}" in roles.log("learner-2")

        # stop the actors, let the replay drain the stream, then count
        assert roles.stop("actor-b", "actor-c") == {"actor-b": 0, "actor-c": 0}
        roles.until(
            lambda: (
                r.xlen(keys.experience) == 0 and r.xpending(keys.experience, GROUP)["pending"] == 0
            ),
            "the stream to drain",
        )
        added = int(r.hget(keys.stats, "produced:experience"))  # every XADD, counted in Lua
        batches = r.zcard(keys.replay_batches)  # every batch id the replay took in
        assert added > 20
        assert r.xlen(keys.deadletter) == 0
        assert batches == added  # none lost, none inserted twice
        assert r.zcard(keys.replay_priorities) == inserted()  # rows: exactly the inserts
        assert "claimed" in roles.log("replay-2")  # the dead replay's entries were redelivered
        assert roles.stop("replay-2", "learner-2") == {"replay-2": 0, "learner-2": 0}
    finally:
        roles.cleanup()


@pytest.mark.timeout(300)
def test_sigkill_an_es_worker_and_the_generations_go_on(r, keys, tmp_path):
    created = qrl("run", "create", "es", "--run", keys.run, "--set", "claim_idle_ms=1500")
    assert created.returncode == 0, created.stderr
    roles = Roles(keys.run, tmp_path)
    es = RunKeys(keys.run)

    def generation() -> int:
        return _int(r.hget(es_params(es), "version"))

    try:
        roles.start("master", "es", "master", "--checkpoint", str(tmp_path / "es.pt"))
        roles.start("worker-a", "es", "worker")
        roles.start("worker-b", "es", "worker")
        roles.until(generation, "generations", until=lambda x: x >= 10)
        roles.kill("worker-a")
        g = generation()
        roles.until(generation, "generations with one worker", until=lambda x: x >= g + 10)
        roles.start("worker-c", "es", "worker")
        g = generation()
        roles.until(generation, "generations after the restart", until=lambda x: x >= g + 10)
        assert r.xlen(es.deadletter) == 0
        assert roles.stop("worker-b", "worker-c", "master") == {
            "worker-b": 0,
            "worker-c": 0,
            "master": 0,
        }
    finally:
        roles.cleanup()
