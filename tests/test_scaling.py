"""Scaling by adding processes: actors join a running Ape-X run with nothing but the Redis
URL and the run name, total throughput rises with them, and killing some does not stop the
run. Every role is a real ``qrl`` process; the env is ``qrl/Sleep-v0`` (1 ms a step, mostly
asleep), so four actors fit on two loaded cores and should step about four times as fast as
one."""

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
                "-v", *args, "--run", self.keys.run,
                env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

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

    def rates(self, seconds: float) -> tuple[dict[int, float], float]:
        """Each actor's env steps/s over the next ``seconds`` (from its reports' counters
        and times), and the learner's updates over the same time."""
        before, updates = dict(self.actors), self.learner
        self.follow(seconds)
        rates = {}
        for ident, (t1, s1) in self.actors.items():
            t0, s0 = before.get(ident, (t1, s1))
            if t1 > t0:
                rates[ident] = (s1 - s0) / (t1 - t0)
        return rates, self.learner - updates

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
def test_adding_actors_raises_throughput_and_killing_some_keeps_the_run_going(
    r, keys, redis_server, tmp_path
):
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
        run.follow(1.0)  # warm-up

        one, updates1 = run.rates(6.0)
        assert set(one) == {0}
        assert one[0] > 300, one  # ~1000 steps/s when asleep 98% of the time
        assert updates1 > 0

        # three more actors join mid-run, with nothing but the URL and the run name
        for name in ("actor-b", "actor-c", "actor-d"):
            run.start(name, "actor", "apex")
        run.wait_for("four actors reporting", lambda: set(run.actors) == {0, 1, 2, 3})
        run.follow(2.0)  # warm-up: all four stepping, their start-up CPU spent
        len_before, in_before = run.stream_len(), replay.stats()["inserted"]
        four, updates4 = run.rates(6.0)
        len_after, inserted4 = run.stream_len(), replay.stats()["inserted"]
        assert set(four) == {0, 1, 2, 3}, four
        total1, total4 = one[0], sum(four.values())
        assert total4 >= 1.8 * total1, f"1 actor {total1:.0f} steps/s, 4 actors {total4:.0f}"
        # the learner and the replay keep up: the learner is not starved by the new actors,
        # the replay takes in what they make (one transition per env step; the stream may
        # buffer up to 64 x 256 of them), and the experience stream stays within its bound
        assert updates4 >= 0.25 * updates1, (updates1, updates4)
        assert inserted4 - in_before >= 0.5 * total4 * 6.0, (inserted4 - in_before, total4)
        assert max(len_before, len_after) <= bound, (len_before, len_after)
        print(f"1 actor {total1:.0f} steps/s, 4 actors {total4:.0f} ({total4 / total1:.2f}x)")
        print(f"learner updates in 6 s: {updates1:.0f} with 1 actor, {updates4:.0f} with 4")
        print(f"replay inserted {inserted4 - in_before} while 4 actors took {total4 * 6:.0f} steps")

        # SIGKILL two actors: the first one (id 0) and one that joined
        run.procs["actor-a"].send_signal(signal.SIGKILL)
        run.procs["actor-c"].send_signal(signal.SIGKILL)
        assert run.procs["actor-a"].wait(10) == -signal.SIGKILL
        assert run.procs["actor-c"].wait(10) == -signal.SIGKILL
        run.follow(1.5)  # reports sent before the kill have arrived
        two, updates2 = run.rates(5.0)  # only actors that reported in the window
        inserted2 = replay.stats()["inserted"]
        assert len(two) == 2 and 0 not in two, two
        assert all(v > 0 for v in two.values())  # the survivors keep stepping ...
        assert sum(two.values()) >= 1.2 * total1, (two, total1)  # ... at two actors' pace
        assert updates2 > 0  # ... and the learner keeps learning from the replay
        assert inserted2 > inserted4
        assert run.stream_len() <= bound
    finally:
        run.stop()
    for name, p in run.procs.items():
        if name not in ("actor-a", "actor-c"):
            assert p.returncode == 0, f"{name} exited with {p.returncode}\n{run.logs()}"
