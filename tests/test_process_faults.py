"""Process faults: SIGKILL an actor, the replay role, the learner and an ES worker mid-run,
start each again, and account for every batch: each one an actor added to the experience
stream reaches the replay exactly once (idempotent by batch id), none is lost, and the
learner resumes from its checkpoint at the step it saved. Real processes, real Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from qrl.algos.es.keys import es_params
from qrl.wire.keys import RunKeys
from qrl.wire.streams import GROUP
from tests.cli import qrl, role


class Roles:
    """Role processes of one run, each logging to its own file."""

    def __init__(self, run: str, log_dir: Path) -> None:
        self.run, self.log_dir, self.procs = run, log_dir, {}

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.log").open("w")
        env = {**os.environ, "QRL_RUN": self.run}
        self.procs[name] = role("-v", *argv, env=env, stdout=log, stderr=log)
        return self.procs[name]

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    def stop(self, *names: str) -> dict[str, int]:
        for n in names:
            self.procs[n].send_signal(signal.SIGTERM)
        return {n: self.procs.pop(n).wait(60) for n in names}

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def cleanup(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _until(cond, what: str, roles: Roles, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert roles.alive(), f"a role died while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _int(v) -> int:
    return int(v) if v is not None else -1


@pytest.mark.timeout(400)
def test_sigkill_actor_replay_and_learner_loses_and_duplicates_nothing(r, keys, tmp_path):
    created = qrl(
        "run", "create", "apex", "--run", keys.run,
        "--set", "actors=2", "--set", "learning_starts=500", "--set", "claim_idle_ms=1500",
        "--set", "replay_capacity=1000000", "--set", "actor_batch=64",
    )  # fmt: skip
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
        _until(lambda: version() >= 30, "the learner to train", roles)

        roles.kill("actor-a")  # mid-run: whatever it had not pushed is gone, nothing else
        roles.start("actor-c", "actor", "apex")
        v = version()
        _until(lambda: version() >= v + 20, "training after the actor was killed", roles)

        # the replay role, killed while it holds entries: another claims them (idle 1.5 s).
        # Freeze it until it is caught holding some, then kill it.
        replay = roles.procs["replay-1"]
        deadline = time.monotonic() + 60
        while True:
            replay.send_signal(signal.SIGSTOP)
            time.sleep(0.2)  # an acknowledgement it sent just before it stopped lands first
            if r.xpending(keys.experience, GROUP)["pending"] > 0:
                break
            replay.send_signal(signal.SIGCONT)
            assert time.monotonic() < deadline, "the replay role never held an entry"
            time.sleep(0.05)
        roles.kill("replay-1")
        roles.start("replay-2", "replay")
        n = inserted()
        _until(lambda: inserted() > n + 500, "the new replay role to insert", roles)

        # the learner: killed, restarted from its checkpoint at the step it saved
        _until(ckpt.exists, "a checkpoint", roles)
        children = _children(roles.procs["learner-1"].pid)
        sampler = [c for c in children if "spawn_main" in _cmdline(c)]
        assert len(sampler) == 1  # the learner's sampler process (beside multiprocessing's
        # resource tracker, which spawn starts and which ends with its last user)
        roles.kill("learner-1")
        _until(lambda: not _alive(sampler[0]), "the orphaned sampler to exit", roles, 10)
        _until(lambda: not any(map(_alive, children)), "every child of the learner to exit", roles)
        saved = int(torch.load(ckpt, weights_only=True)["step"])
        assert saved > 0
        roles.start("learner-2", *learner)
        v = version()
        _until(lambda: version() >= v + 20, "training after the learner restart", roles)
        assert f"at update {saved}" in roles.log("learner-2")

        # stop the actors, let the replay drain the stream, then count
        assert roles.stop("actor-b", "actor-c") == {"actor-b": 0, "actor-c": 0}
        _until(
            lambda: (
                r.xlen(keys.experience) == 0 and r.xpending(keys.experience, GROUP)["pending"] == 0
            ),
            "the stream to drain",
            roles,
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
        _until(lambda: generation() >= 10, "generations", roles)
        roles.kill("worker-a")
        g = generation()
        _until(lambda: generation() >= g + 10, "generations with one worker", roles)
        roles.start("worker-c", "es", "worker")
        g = generation()
        _until(lambda: generation() >= g + 10, "generations after the restart", roles)
        assert r.xlen(es.deadletter) == 0
        assert roles.stop("worker-b", "worker-c", "master") == {
            "worker-b": 0, "worker-c": 0, "master": 0,
        }  # fmt: skip
    finally:
        roles.cleanup()
