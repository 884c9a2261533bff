"""Scaling by adding processes: actors join a running Ape-X run with nothing but the Redis
URL and the run name, each steps and the learner and the replay go on with them, and
killing some does not stop the run. Every role is a real ``qrl`` process; the env is
``qrl/Sleep-v0`` (1 ms a step, mostly asleep). How total throughput grows with the actors is
a measurement, not a test: ``benchmarks/scaling.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from qrl.algos.apex.config import ApexConfig
from qrl.replay.role import make_replay
from qrl.rl.simenv import SLEEP_ENV
from qrl.runtime.control import request_stop
from qrl.runtime.runs import create_run
from tests.cli import role
from tests.helpers import kill_all, run_reader, wait_until

pytestmark = pytest.mark.slow


class Run:
    """The role processes of one run, and what their metrics say about them."""

    def __init__(self, r, keys, url: str, log_dir: Path) -> None:
        self.r, self.keys, self.log_dir = r, keys, log_dir
        self.env = {**os.environ, "QRL_REDIS_URL": url}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.reader = run_reader(r, keys)
        self.actors: dict[int, tuple[float, float]] = {}  # id -> (time, steps) of last report
        self.learner = 0.0  # updates in the learner's last report

    def start(self, name: str, *args: str) -> None:
        with (self.log_dir / f"{name}.log").open("wb") as log:
            self.procs[name] = role(
                "-v",
                *args,
                "--run",
                self.keys.run,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def logs(self) -> str:
        return "\n".join(
            f"--- {n}: {(self.log_dir / f'{n}.log').read_text(errors='replace')[-1500:]}"
            for n in self.procs
        )

    def follow(self, seconds: float) -> None:
        """Read the metrics for ``seconds``; every role must stay alive."""
        end = time.monotonic() + seconds
        while True:
            for m in self.reader.read(block_ms=100):
                if m["role"] == "actor":
                    self.actors[m["id"]] = (m["time"], m["values"]["steps"])
                elif m["role"] == "learner":
                    self.learner = m["values"]["updates"]
            dead = {
                n: p.returncode
                for n, p in self.procs.items()
                if p.poll() is not None and p.returncode != -signal.SIGKILL
            }
            assert not dead, f"roles exited: {dead}\n{self.logs()}"
            if time.monotonic() >= end:
                return

    def wait_for(self, what: str, cond, timeout: float = 60.0) -> None:
        wait_until(
            cond, what, timeout, every=0, between=lambda: self.follow(0.1), context=self.logs
        )

    def moved_on(self, since: float, steps: dict[int, float]) -> set[int]:
        """The actors that reported after ``since`` (their clock: ours) more steps than in
        ``steps``."""
        return {
            ident
            for ident, (t, n) in self.actors.items()
            if t > since and n > steps.get(ident, 0.0)
        }

    def stream_len(self) -> int:
        return int(self.r.xlen(self.keys.experience))

    def stop(self) -> None:
        request_stop(self.r, self.keys)
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(deadline - time.monotonic(), 0.1))
        kill_all(self.procs.values())


@pytest.mark.timeout(240)
def test_actors_join_a_running_run_and_killing_some_keeps_it_going(r, keys, redis_server, tmp_path):
    cfg = ApexConfig(
        env=SLEEP_ENV,
        actors=4,
        envs_per_actor=16,  # a vector step owes 16 ms of sleep: acting is a few % of it
        hidden=(64, 64),
        batch_size=32,
        learning_starts=500,
        replay_capacity=20_000,
        steps_per_update=0,  # no rate limit: actor throughput is the actors', not the learner's
    )
    create_run(r, keys, "apex", cfg)
    replay = make_replay(r, keys, cfg)
    run = Run(r, keys, redis_server.url, tmp_path)
    bound = cfg.stream_maxlen + 8  # undelivered < maxlen, plus what the replay holds (count 8)
    try:
        run.start("replay", "replay")
        run.start("learner", "learner", "apex", "--device", "cpu")
        run.start("actor-a", "actor", "apex")  # --id auto: the first actor is 0
        run.wait_for("actor 0 and learner updates", lambda: 0 in run.actors and run.learner > 0)

        # three more actors join mid-run, with nothing but the URL and the run name; all four
        # step on, the learner learns and the replay takes in what they make
        for name in ("actor-b", "actor-c", "actor-d"):
            run.start(name, "actor", "apex")
        run.wait_for("four actors reporting", lambda: set(run.actors) == {0, 1, 2, 3})
        joined, steps = time.time(), {i: n for i, (_, n) in run.actors.items()}
        updates, inserted = run.learner, replay.stats()["inserted"]
        run.wait_for("all four to step on", lambda: run.moved_on(joined, steps) == {0, 1, 2, 3})
        run.wait_for("the learner to go on", lambda: run.learner > updates)
        run.wait_for("the replay to take more in", lambda: replay.stats()["inserted"] > inserted)
        assert run.stream_len() <= bound

        # SIGKILL two actors: the first one (id 0) and one that joined
        run.procs["actor-a"].send_signal(signal.SIGKILL)
        run.procs["actor-c"].send_signal(signal.SIGKILL)
        assert run.procs["actor-a"].wait(10) == -signal.SIGKILL
        assert run.procs["actor-c"].wait(10) == -signal.SIGKILL
        killed, steps = time.time(), {i: n for i, (_, n) in run.actors.items()}
        updates, inserted = run.learner, replay.stats()["inserted"]
        # the survivors keep stepping (a report made after the kill is a survivor's), the
        # learner keeps learning from the replay, the replay takes in what they make
        run.wait_for("two survivors to step on", lambda: len(run.moved_on(killed, steps)) == 2)
        assert 0 not in run.moved_on(killed, steps)
        run.wait_for("the learner to go on", lambda: run.learner > updates)
        run.wait_for("the replay to take more in", lambda: replay.stats()["inserted"] > inserted)
        assert run.stream_len() <= bound
    finally:
        run.stop()
    for name, p in run.procs.items():
        if name not in ("actor-a", "actor-c"):
            assert p.returncode == 0, f"{name} exited with {p.returncode}\n{run.logs()}"
