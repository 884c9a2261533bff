"""``qrl train --one-process``: every role of a run as a thread of one process, taking turns
(:mod:`qrl.runtime.turns`). The same seed gives the same weights after the same updates,
every tensor bit for bit, and another seed others (A3C's and Gorila's: the checkpoint their
parameter server writes); it solves CartPole with Ape-X, IMPALA, PPO and A3C (``slow``; Gorila's
one-process run solves too, in 4-5 minutes: its actors, learner and parameter server take
turns on one core, so it is left out of the tier);
the runs it cannot run are refused in one line; the turns themselves go in a fixed order,
one thread at a time, and a wait hands the turn on."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

from qrl.algos import ALGOS
from qrl.cli import main
from qrl.jobs.train import Budget, OneProcessRefused, run_training
from qrl.runtime.turns import TICK, Table
from qrl.wire import clock
from tests.cli import qrl
from tests.helpers import weights

# updates per run: a few seconds each, past the first updates' start-up (Ape-X's replay
# filling to learning_starts, PPO's paced rollouts)
UPDATES = {"apex": 40, "impala": 20, "ppo": 6, "es": 6, "r2d2": 10, "apex-dpg": 20}
UPDATES |= {"a3c": 30, "gorila": 40}  # (the parameter server's updates: gradients applied)
ENVS = {"apex-dpg": "Pendulum-v1"}


@pytest.fixture(autouse=True)
def _process_state() -> Any:
    """What a run in this process leaves set process-wide goes back after each test: the
    job's SIGINT/SIGTERM handlers, torch's threads and generator (the learner seeds it)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)
    torch.set_num_threads(threads)
    torch.random.set_rng_state(rng)


def one_process(algo: str, run_dir: Path, seed: int = 0) -> int:
    """A one-process run of ``algo`` in this process (its own embedded Redis) until its
    learner made ``UPDATES[algo]`` updates, evaluated every 0.2 s meanwhile (at whichever
    turns the clock says: the weights must not depend on them); its exit code."""
    a = ALGOS[algo]
    cfg = a.config(env=ENVS.get(algo, "CartPole-v1"), seed=seed)
    budget = Budget(target_return=None, max_time=None, max_updates=UPDATES[algo], eval_every=0.2)
    return run_training(
        a,
        cfg,
        budget,
        redis_url=None,
        run=f"{algo}-s{seed}",
        run_dir=run_dir,
        console=Console(file=io.StringIO()),
        one_process=True,
    )


@pytest.mark.parametrize("algo", ["apex", "impala", "ppo", "a3c", "gorila"])
def test_the_same_seed_gives_the_same_weights(algo: str, tmp_path: Path) -> None:
    runs = {}
    for name, seed in (("first", 0), ("again", 0), ("other", 1)):
        assert one_process(algo, tmp_path / name, seed) == 0
        result = json.loads((tmp_path / name / "result.json").read_text())
        assert result["updates"] == UPDATES[algo], result
        runs[name] = weights(tmp_path / name)
    first, again, other = runs["first"], runs["again"], runs["other"]
    assert first.keys() == again.keys() == other.keys()
    differ = [name for name in first if first[name] != again[name]]
    assert not differ, f"seed 0 twice, tensors not bit for bit the same: {differ}"
    assert any(first[name] != other[name] for name in first), "seed 1 gave seed 0's weights"


@pytest.mark.parametrize("algo", ["es", "r2d2", "apex-dpg"])
def test_other_algorithms_take_turns_too(algo: str, tmp_path: Path) -> None:
    for name in ("first", "again"):
        assert one_process(algo, tmp_path / name) == 0
    assert weights(tmp_path / "first") == weights(tmp_path / "again")


def test_the_command_line_gives_the_weights_of_another_process(tmp_path: Path) -> None:
    """``qrl train apex --one-process --max-updates N`` in a process of its own (another hash
    seed) leaves the checkpoint a run in this process leaves."""
    assert one_process("apex", tmp_path / "here") == 0
    env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_URL"}
    out = qrl(
        "train",
        "apex",
        "--one-process",
        "--env",
        "CartPole-v1",
        "--seed",
        "0",
        "--max-updates",
        str(UPDATES["apex"]),
        "--run-dir",
        str(tmp_path / "cli"),
        env={**env, "PYTHONHASHSEED": "12345"},
        timeout=240,
    )
    assert out.returncode == 1, out.stderr[-3000:]  # its budget ran out short of the target
    assert "4 roles in one process" in " ".join(out.stderr.split())  # (lines wrap at 80)
    assert weights(tmp_path / "cli") == weights(tmp_path / "here")
    logs = {p.name: p.read_text() for p in (tmp_path / "cli" / "logs").iterdir()}
    assert sorted(logs) == ["actor0.log", "actor1.log", "learner.log", "replay0.log"]
    assert f"reached its limit of {UPDATES['apex']} updates" in logs["learner.log"]
    assert "replay 0 started" in logs["replay0.log"]


def test_a_role_that_fails_ends_the_job_saying_why(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"not a checkpoint")
    out = Console(file=io.StringIO(), width=400)
    a = ALGOS["ppo"]
    budget = Budget(target_return=None, max_time=60, max_updates=3)
    code = run_training(
        a,
        a.config(),
        budget,
        redis_url=None,
        run="fails",
        run_dir=run_dir,
        console=out,
        one_process=True,
    )
    assert code == 2
    said = out.file.getvalue()  # type: ignore[attr-defined]
    log = (run_dir / "logs" / "learner0.log").read_text()
    assert "ERROR qrl.jobs.launch[learner0]: cannot load checkpoint" in log
    last = log.strip().splitlines()[-1]  # as with processes: its log's last line says why
    assert f"learner0 failed: {last}" in said, said
    result = json.loads((run_dir / "result.json").read_text())
    assert result["failed"] == {"learner0": last}, result


RUNS = "runs roles that take turns (apex, apex-dpg, r2d2, impala, ppo, es, a3c, gorila, with one "
RUNS += "learner): "


@pytest.mark.parametrize(
    "algo, over, why",
    [
        ("impala", {"inference": "central"}, RUNS + "impala's inference and stepper roles"),
        ("ppo", {"learners": 2}, "runs one learner: learners=2 makes a pool of processes"),
    ],
)
def test_what_cannot_take_turns_is_refused(algo: str, over: dict, why: str, tmp_path: Path) -> None:
    a = ALGOS[algo]
    with pytest.raises(OneProcessRefused) as refused:
        run_training(
            a,
            a.config(**over),
            Budget(),
            redis_url=None,
            run="r",
            run_dir=tmp_path / "r",
            one_process=True,
        )
    assert str(refused.value).startswith("--one-process " + why.split(": ")[0])
    assert why in str(refused.value)
    assert not (tmp_path / "r").exists()  # refused before anything started


def test_the_command_line_refuses_in_one_line() -> None:
    args = ["train", "impala", "--one-process", "--set", "inference=central"]
    out = CliRunner().invoke(main, args, env={"QRL_REDIS_URL": None})
    assert out.exit_code == 2
    lines = [line for line in out.output.splitlines() if line.strip()]
    why = "impala's inference and stepper roles cannot take turns in one process"
    assert lines[-1] == f"Error: --one-process {RUNS}{why}"
    out = CliRunner().invoke(main, ["train", "apex", "--one-process", "--acl"])
    assert out.exit_code == 2 and "no --acl" in out.output
    helped = CliRunner().invoke(main, ["train", "impala", "--help"]).output
    assert "--one-process" in helped and "deterministic for a seed" in " ".join(helped.split())


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["apex", "impala", "ppo", "a3c"])
def test_one_process_solves_cartpole(algo: str, tmp_path: Path) -> None:
    """The command as a user types it, with the target and confirmation ``qrl train`` uses."""
    env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_URL"}
    run_dir = tmp_path / "run"
    out = qrl(
        "train",
        algo,
        "--one-process",
        "--env",
        "CartPole-v1",
        "--seed",
        "0",
        "--max-time",
        "600",
        "--run-dir",
        str(run_dir),
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["reached"] and result["target"] == 475.0, result
    assert result["confirm_episodes"] == 100 and result["confirm_return"] >= 475.0, result


# -- the turns (no Redis)


def test_turns_go_round_in_seating_order_a_roles_helpers_after_it() -> None:
    said: list[str] = []

    def say(name: str, times: int = 2) -> None:
        for _ in range(times):
            said.append(name)
            clock.sleep(1.0)  # (a wait: the next seat's turn)

    def role(name: str) -> None:
        helpers = clock.current().helpers()  # a multiprocessing context whose Process is a seat
        helpers.Process(target=say, args=(f"{name}.helper",), name=f"{name}.helper").start()
        for _ in range(2):
            said.append(name)
            clock.current().turn()  # (a step done)

    table = Table()
    with table.sit("job"):
        seats = [table.start("a", lambda: role("a")), table.start("b", lambda: say("b"))]
        say("job", 4)
        assert [s.name for s in table.seats] == ["job"]  # the others ended and left
    assert said == [
        "job",
        "a",
        "a.helper",
        "b",
        "job",
        "a",
        "a.helper",
        "b",
        "job",
        "job",
    ]
    assert [s.exitcode for s in seats] == [0, 0]


def test_one_thread_at_a_time_and_a_wait_hands_the_turn_on() -> None:
    running, most, ready = [0], [0], threading.Event()
    times: list[float] = []

    def busy() -> None:
        for _ in range(50):
            running[0] += 1
            most[0] = max(most[0], running[0])
            time.sleep(0.0005)  # real time: nobody else may run meanwhile
            running[0] -= 1
            clock.current().turn()
        ready.set()

    def waits() -> int:
        start = clock.now()
        got = clock.current().poll(lambda timeout: ready.is_set(), start + 10.0)
        times.append(clock.now() - start)
        return 0 if got else 3

    def gives_up() -> int:
        return 3 if clock.current().poll(lambda timeout: False, clock.now() + 5 * TICK) else 0

    def fails() -> None:
        raise RuntimeError("on purpose")

    table = Table()
    with table.sit("job"):
        jobs = {"busy": busy, "waits": waits, "gives-up": gives_up, "fails": fails}
        seats = [table.start(name, body) for name, body in jobs.items()]
        for seat in seats:
            seat.join()  # (the job hands its turns on meanwhile)
    assert most[0] == 1
    # its wait ended in the round after the one where busy set the event, its 51st
    assert 50 * TICK <= times[0] <= 52 * TICK, times
    assert [s.exitcode for s in seats] == [0, 0, 0, 1]
    assert clock.current() is clock.REAL  # the job's thread is on real time again
