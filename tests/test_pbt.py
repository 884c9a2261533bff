"""Population-based training on a real Redis: exploit copies a trial's whole state and its
hyperparameters (read back, and taken in by a real learner through the file a slot hands it);
hostile scoreboard entries crash nothing and cause no exploit; leases; a SIGKILLed worker's
trial goes on with another worker from its last stored state (real processes); ``qrl pbt``
from the CLI; its ACL users (a trial's processes cannot write the trial's records, and the
users go when the population ends)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from rich.console import Console

from qrl.algos import ALGOS
from qrl.pbt.config import Explore, PBTConfig
from qrl.pbt.controller import Follower, run_population, setup
from qrl.pbt.exploit import choose, current, exploit, explore
from qrl.pbt.population import LINEAGE_KEEP, MAX_LEASE_MS, Population
from qrl.pbt.worker import Renewal, finish, take_better
from qrl.runtime.algorithm import RoleContext
from qrl.runtime.live import set_live
from qrl.runtime.snapshot import SnapshotStore, capture
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore
from tests.cli import ROOT, qrl
from tests.helpers import pid_alive, redis7, redis_binaries, wait_until


def _pcfg(keys: RunKeys, **kw) -> PBTConfig:
    explore = [Explore.parse("lr=1e-4..1e-2:log"), Explore.parse("entropy_cost=1e-4..1e-1:log")]
    values = {
        "name": keys.run,
        "algo": "ppo",
        "env": "CartPole-v1",
        "population": 2,
        "explore": explore,
        "target_return": 475.0,
        **kw,
    }
    return PBTConfig(**values)


def _learner(r, trial: str, snapshot: Path | None = None):
    """The trial's real PPO learner, made as its role process makes it (``snapshot``: the
    file it resumes from and saves to)."""
    algo = ALGOS["ppo"]
    keys = RunKeys(trial)
    cfg = current(r, _pcfg(RunKeys(trial.rsplit("-t", 1)[0])), trial)
    ctx = RoleContext(r, lambda: r, keys, cfg, 0, "cpu", snapshot=snapshot)
    return algo.role("learner").make(ctx)


def _resumed(r, trial: str, folder: Path):
    """The trial's learner as a segment starts it: the slot hands it the trial's snapshot
    from Redis in a file (none: no file), which it resumes from."""
    path = folder / trial / "snapshot"
    SnapshotStore(r, RunKeys(trial)).to_file(path)
    return _learner(r, trial, path)


def _scored(r, keys: RunKeys) -> tuple[PBTConfig, Population, str, str]:
    """A population of two trials on the scoreboard: the first at 1.0, the second at 2.0."""
    pcfg = _pcfg(keys)
    pop = setup(r, pcfg)
    t0, t1 = pcfg.trials()
    pop.post(t0, 1.0)
    pop.post(t1, 2.0)
    return pcfg, pop, t0, t1


def test_explore_specs_parse_sample_and_perturb_within_range():
    rng = random.Random(0)
    e = Explore.parse("lr=1e-5..1e-1:log")
    assert (e.kind, e.low, e.high) == ("log", 1e-5, 1e-1)
    assert all(1e-5 <= e.sample(rng) <= 1e-1 for _ in range(100))
    assert e.perturb(1e-1, rng, (0.8, 1.2)) in (0.08, 0.1)  # x1.2 is clipped at the top
    c = Explore.parse("clip=0.1,0.2,0.3")
    assert c.perturb(0.2, rng, (0.8, 1.2)) in (0.1, 0.3)
    for bad in ("lr", "lr=1..0", "lr=0..1:log", "lr=a..b", "LR=1..2", "lr=1,nan"):
        with pytest.raises(ValueError):
            Explore.parse(bad)


def test_a_uniform_range_over_more_than_two_decades_is_warned_of():
    """``lr=1e-5..1e-1`` draws 99% of its values from its top two decades: said, with the
    ``:log`` that draws every decade alike; a log range, a narrow one or choices are not."""
    warning = Explore.parse("lr=1e-5..1e-1").warning()
    assert warning is not None and "99%" in warning and "lr=1e-05..0.1:log" in warning
    for fine in ("lr=1e-5..1e-1:log", "lr=1e-4..1e-2", "gamma=0.9,0.99,0.999", "x=-1..1e3"):
        assert Explore.parse(fine).warning() is None, fine


@pytest.mark.slow
def test_exploit_copies_state_and_hyperparameters_exactly(r, keys, tmp_path):
    pcfg = _pcfg(keys)
    pop = setup(r, pcfg)
    src, dst = pcfg.trials()
    # the source trained a little: a real learner's network and Adam state in its snapshot
    learner = _learner(r, src)
    x = torch.randn(8, 4)
    for _ in range(3):
        learner.opt.zero_grad()
        sum((p * x.sum()).pow(2).sum() for p in learner.net.parameters()).backward()
        learner.opt.step()
    SnapshotStore(r, RunKeys(src)).save(capture(learner.net, learner.opt, 7))
    WeightStore(r, RunKeys(dst)).publish(_learner(r, dst).net, 40)  # the target's own weights
    before = current(r, pcfg, src)
    event = exploit(r, pop, pcfg, dst, src, random.Random(5), {src: 2.0, dst: 1.0})
    # hyperparameters: the source's, perturbed or redrawn by the same draws
    want = explore(pcfg, {"lr": before.lr, "entropy_cost": before.entropy_cost}, random.Random(5))
    after = current(r, pcfg, dst)
    assert (after.lr, after.entropy_cost) == (want["lr"], want["entropy_cost"])
    assert event["values"] == want and event["source"] == src and event["trial"] == dst
    assert pop.lineage(pcfg.trials())[-1] == event
    follow = Follower(pcfg, tmp_path)  # the controller writes each event to the run dir once
    follow(r, pop)
    follow(r, pop)
    lines = (tmp_path / "lineage.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [event] and follow.events == 1
    # state: read back from Redis, and taken in by the target's learner as it starts
    copied = SnapshotStore(r, RunKeys(dst)).fetch()
    assert copied.updates == event["version"] == 41  # above the target's published version
    mine = capture(learner.net, learner.opt, 7)
    assert copied.model.keys() == mine.model.keys() and copied.opt.keys() == mine.opt.keys()
    assert all(np.array_equal(copied.model[k], mine.model[k]) for k in mine.model)
    assert all(np.array_equal(copied.opt[k], mine.opt[k]) for k in mine.opt)
    taken = _resumed(r, dst, tmp_path)
    assert taken.updates == 41
    for k, v in learner.net.state_dict().items():
        assert torch.equal(taken.net.state_dict()[k], v)
    ours, theirs = learner.opt.state_dict()["state"], taken.opt.state_dict()["state"]
    assert ours.keys() == theirs.keys() and ours
    for i in ours:
        assert all(torch.equal(ours[i][n].cpu(), theirs[i][n].cpu()) for n in ours[i])
    assert taken.opt.param_groups[0]["lr"] == want["lr"]
    pop.trained(src)
    shown = qrl("status", "--run", keys.run)  # the population: trials, values, lineage
    assert shown.returncode == 0, shown.stderr
    assert dst in shown.stdout and "exploit/explore" in shown.stdout
    status = json.loads(qrl("status", "--run", keys.run, "--json").stdout)
    assert status["lineage"][-1]["source"] == src
    assert status["trials"][1]["values"]["lr"] == want["lr"]
    assert [t["segments"] for t in status["trials"]] == [1, 0]  # the burn-in's count


def test_es_exploit_copies_the_published_parameters_and_master_state(r, keys):
    pcfg = _pcfg(keys, algo="es", explore=[Explore.parse("lr=1e-3..1e-1:log")])
    pop = setup(r, pcfg)
    src, dst = pcfg.trials()
    params = {"theta": np.arange(6, dtype=np.float32), "adam_m": np.ones(6, np.float32)}

    def published(trial: str) -> WeightStore:  # where ES's master publishes: not `weights`
        return WeightStore(r, RunKeys(trial), ALGOS["es"].weights_key(RunKeys(trial)))

    published(src).publish(params, 12, {"obs_count": 3})
    published(dst).publish({"theta": np.zeros(6, np.float32)}, 30)
    event = exploit(r, pop, pcfg, dst, src, random.Random(1))
    w = published(dst).fetch()
    assert w.version == event["version"] == 31 and w.meta == {"obs_count": 3}
    assert w.params.keys() == params.keys()
    assert all(np.array_equal(w.params[k], v) for k, v in params.items())


def test_a_snapshot_that_does_not_fit_is_not_loaded(r, keys, tmp_path):
    pcfg = _pcfg(keys)
    setup(r, pcfg)
    trial = pcfg.trials()[0]
    store, path = SnapshotStore(r, RunKeys(trial)), tmp_path / trial / "snapshot"
    learner = _learner(r, trial)
    good = capture(learner.net, learner.opt, 5)
    bad = capture(learner.net, learner.opt, 9)
    name = next(iter(bad.model))
    bad.model[name] = np.zeros((3, 3), np.float32)  # another shape
    store.save(bad)
    assert _resumed(r, trial, tmp_path).updates == 0
    bad = capture(learner.net, learner.opt, 9)
    bad.model[name] = np.full_like(bad.model[name], np.nan)
    store.save(bad)
    assert _resumed(r, trial, tmp_path).updates == 0
    store.save(good)
    assert _resumed(r, trial, tmp_path).updates == 5
    r.set(store.key, b"garbage")  # not handed in: no file, not the last one's left there
    assert _resumed(r, trial, tmp_path).updates == 0 and not path.exists()
    # handed back: the state a learner left as it stopped, checked, stored by the slot
    taken = _learner(r, trial, path)
    taken.updates = 7
    taken.save()
    assert store.from_file(path) and store.fetch().updates == 7 and not path.exists()
    path.write_bytes(b"half a snapshot")  # not one: not stored
    assert not store.from_file(path) and store.fetch().updates == 7


def test_a_segment_is_scored_by_its_training_returns_unless_told_its_evaluation(r, keys):
    # a greedy evaluation stuck on one action (-89.8) must not outrank the training returns
    result = {"episodic_return": -150.0, "eval_return": -89.8}
    for score, want in (("train", -150.0), ("eval", -89.8)):
        pcfg = _pcfg(keys, score=score, exploit=False)
        pop = Population(r, pcfg.name)
        t0 = pcfg.trials()[0]
        finish(pop, pcfg, t0, result)
        assert pop.scores(pcfg.trials()) == {t0: want}
        pop.forget(t0)
        finish(pop, pcfg, t0, {**result, "episodic_return": None})
        assert pop.scores(pcfg.trials()) == ({} if score == "train" else {t0: want})


@pytest.mark.slow
def test_hostile_scoreboard_entries_crash_nothing_and_cause_no_exploit(r, keys, tmp_path):
    pcfg = _pcfg(keys, population=3)
    pop = setup(r, pcfg)
    t0, t1, t2 = pcfg.trials()
    for trial in (t0, t1, t2):  # each has state an exploit could copy
        learner = _learner(r, trial)
        SnapshotStore(r, RunKeys(trial)).save(capture(learner.net, learner.opt, 1))
    pop.post(t0, 10.0)
    r.set(pop.key(t1, "score"), json.dumps({"score": float("nan")}).replace("NaN", "1e999"))
    r.set(pop.key(t2, "score"), '{"score": NaN}')
    r.set(pop.key("intruder", "score"), json.dumps({"score": 1e9}))  # not a trial: not read
    assert pop.scores(pcfg.trials()) == {t0: 10.0}
    finish(pop, pcfg, t0, {"episodic_return": 10.0})  # posts
    assert take_better(pop, pcfg, t0, random.Random(0)) is None
    for value in (
        '"text"',
        "[1]",
        "{}",
        '{"score": true}',
        '{"score": "1"}',
        "\xff",
        '{"score": 1e300}',
        '{"score": -1e13}',
        '{"score": 1e3000}',
    ):
        r.set(pop.key(t1, "score"), value)
        assert pop.scores(pcfg.trials()) == {t0: 10.0}
    r.set(pop.key(t1, "score"), "z" * 2_000_000)  # over the cap: not read
    assert pop.scores(pcfg.trials()) == {t0: 10.0}
    r.delete(pop.key(t0, "score"))
    r.rpush(pop.key(t0, "score"), "not a string")
    assert pop.scores(pcfg.trials()) == {}
    finish(pop, pcfg, t0, {"episodic_return": float("nan")})
    assert take_better(pop, pcfg, t0, random.Random(0)) is None
    r.xadd(pop.key(t1, "lineage"), {"event": "{}"})  # another type
    junk = [{"n": 0, "event": {}}, {"n": 1, "event": "x"}, {"n": True, "event": {}}, "x", []]
    r.set(pop.key(t2, "lineage"), json.dumps(junk))
    Follower(pcfg, tmp_path)(r, pop)  # what the controller does every second
    assert qrl("status", "--run", keys.run).returncode == 0
    assert pop.lineage(pcfg.trials()) == []
    r.set(pop.key(t2, "lineage"), json.dumps([{"n": 1, "event": {"x": "y" * 100_000}}]))
    assert pop.lineage(pcfg.trials()) == []  # over the cap: not read
    assert r.get(pop.key(t0, "lineage")) is None  # nothing of ours was recorded: no exploit
    # what a writer put in a lease and the lineage is shown escaped, never obeyed
    r.set(pop.key(t1, "lease"), "\x1b]0;owned\x07", px=60_000)
    escape = {"trial": "\x1b[2J[red]x", "values": {"\x1b[5m": "\x9b"}, "time": 1.0}
    r.delete(pop.key(t1, "lineage"))
    r.set(pop.key(t1, "lineage"), json.dumps([{"n": 1, "event": escape}]))
    shown = qrl("status", "--run", keys.run)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout and "\x9b" not in shown.stdout
    assert "\\x1b]0;owned" in shown.stdout and "\\x1b[2J[red]x" in shown.stdout


def test_a_trials_lineage_keeps_its_last_events_and_a_follower_takes_each_once(r, keys, tmp_path):
    pcfg = _pcfg(keys)
    pop = setup(r, pcfg)
    t0, t1 = pcfg.trials()
    follow = Follower(pcfg, tmp_path)
    for i in range(40):  # more than a trial keeps, and read now and then
        pop.record({"time": float(i), "trial": t0 if i % 3 else t1, "source": "x"})
        if i % 4 == 3:
            follow(r, pop)
    follow(r, pop)
    lines = [json.loads(line) for line in (tmp_path / "lineage.jsonl").read_text().splitlines()]
    assert [e["time"] for e in lines] == [float(i) for i in range(40)]  # each once, in order
    kept = pop.lineage(pcfg.trials())
    assert len([e for e in kept if e["trial"] == t0]) == LINEAGE_KEEP
    assert kept[-1]["time"] == 39.0


def test_a_low_trial_takes_the_top_trials_latest_state_as_a_slot_takes_it(r, keys):
    pcfg, pop, low, top = _scored(r, keys)
    learner = _learner(r, top)
    SnapshotStore(r, RunKeys(low)).save(capture(learner.net, learner.opt, 3))
    SnapshotStore(r, RunKeys(top)).save(capture(learner.net, learner.opt, 8))
    assert take_better(pop, pcfg, top, random.Random(0)) is None  # the top trial trains on
    SnapshotStore(r, RunKeys(top)).save(capture(learner.net, learner.opt, 20))  # it trained on
    event = take_better(pop, pcfg, low, random.Random(0))
    assert (event["trial"], event["source"]) == (low, top)
    assert SnapshotStore(r, RunKeys(low)).fetch().updates == event["version"] == 21  # the latest
    assert pop.scores(pcfg.trials()) == {top: 2.0}  # unranked until its own segment is scored


def test_scores_csv_gets_a_row_when_a_score_or_a_value_changes(r, keys, tmp_path):
    pcfg, pop, t0, t1 = _scored(r, keys)
    follow = Follower(pcfg, tmp_path, every=0.0)
    for _ in range(3):  # nothing new: no new rows
        follow(r, pop)
    pop.post(t0, 3.0)
    follow(r, pop)
    set_live(r, RunKeys(t1), ALGOS["ppo"].config, {"lr": 0.005})  # the same score, a new lr
    follow(r, pop)
    follow(r, pop)
    rows = [row.split(",")[1:4] for row in (tmp_path / "scores.csv").read_text().splitlines()]
    assert [row[:2] for row in rows[1:]] == [[t0, "1.0"], [t1, "2.0"], [t0, "3.0"], [t1, "2.0"]]
    assert rows[-1][2] == "0.005"


def test_the_lineage_plot_says_what_ranked_the_trials(r, keys, tmp_path):
    from qrl.runtime.plot import draw_population

    pcfg, pop, t0, t1 = _scored(r, keys)
    Follower(pcfg, tmp_path)(r, pop)
    for score, label in (("train", "score (training return)"), ("eval", "score (evaluation)")):
        (tmp_path / "pbt.json").write_text(
            pcfg.model_copy(update={"score": score}).model_dump_json()
        )
        fig = draw_population(tmp_path)
        assert fig.axes[0].get_ylabel() == label
        assert [line.get_label() for line in fig.axes[0].get_lines()][:2] == [t0, t1]


@pytest.mark.slow
def test_qrl_pbt_refuses_bad_settings_before_it_starts(tmp_path):
    for args, why in (
        (["--explore", "hidden=1..2"], "cannot change while the run runs"),
        (["--explore", "lr"], "expected FIELD=LOW..HIGH"),
        (["--explore", "lr=1e-3..1e-1:log", "--population", "1"], "1"),
        # warned of first (below)
        (["--explore", "lr=1e-5..1e-1", "--explore", "lr=1e-2..1e-1"], "a field explored twice"),
        ([], "pass at least one --explore FIELD=LOW..HIGH"),
        (["--explore", "lr=1e-3..1e-1", "--explore", "lr=1e-2..1e-1"], "a field explored twice"),
    ):
        proc = qrl("pbt", "ppo", "--env", "CartPole-v1", "--run-dir", str(tmp_path), *args)
        last = proc.stderr.strip().splitlines()[-1]  # click's usage lines may come before it
        assert proc.returncode == 2 and last.startswith("Error:") and why in last, (args, last)
        assert "pydantic" not in proc.stderr, proc.stderr  # its own words, not a model's dump
        wide = "lr=1e-5..1e-1" in args
        assert ("warning: lr=1e-05..0.1 draws uniformly" in proc.stderr) == wide, proc.stderr


def test_a_slot_goes_on_past_writers_leases_and_configs_and_stops_when_asked(
    r, keys, tmp_path, caplog
):
    pcfg = _pcfg(keys)
    pop = setup(r, pcfg)
    t0, t1 = pcfg.trials()
    r.set(pop.key(t0, "lease"), "x", px=MAX_LEASE_MS)  # a writer's lease, within bounds
    r.rpush(pop.key(t0, "freed"), "x")  # and a freed time of another type
    r.set(RunKeys(t1).config, b"not a config")  # the free trial cannot be trained
    from concurrent.futures import ThreadPoolExecutor

    from qrl.pbt.worker import slot

    with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.INFO, "qrl.pbt.worker"):
        done = pool.submit(slot, os.environ["QRL_REDIS_URL"], keys.run, tmp_path)
        # it takes t1, cannot train it, gives it back, waits, and takes it again
        taken = lambda: caplog.text.count(f"segment of {t1}")  # noqa: E731
        wait_until(taken, "the slot to take t1 twice", 30, until=lambda n: n >= 2)
        assert not done.done(), done.result()
        r.hset(pop.keys.control, "stop", 1)  # `qrl run stop NAME`: the slot returns
        assert done.result(timeout=10) == 0
    assert pop.holders(pcfg.trials()) == {t0: "x"}  # nothing held, nothing broken


def test_burn_in_keeps_trials_from_copying_or_being_copied_until_trained(r, keys):
    pcfg, pop, low, top = _scored(r, keys)
    pcfg = pcfg.model_copy(update={"burn_in": 2})
    learner = _learner(r, top)
    SnapshotStore(r, RunKeys(top)).save(capture(learner.net, learner.opt, 8))
    result = {"episodic_return": 1.0}
    finish(pop, pcfg, low, result)
    finish(pop, pcfg, top, {"episodic_return": 2.0})
    assert pop.segments(pcfg.trials()) == {low: 1, top: 1}
    assert take_better(pop, pcfg, low, random.Random(0)) is None  # neither is past it
    finish(pop, pcfg, low, result)
    assert take_better(pop, pcfg, low, random.Random(0)) is None  # the top one is not
    r.set(pop.key(top, "segments"), "2e9")  # a writer's: not a count, so none
    assert pop.segments(pcfg.trials())[top] == 0
    assert take_better(pop, pcfg, low, random.Random(0)) is None
    r.set(pop.key(top, "segments"), 1)
    finish(pop, pcfg, top, {"episodic_return": 2.0})
    event = take_better(pop, pcfg, low, random.Random(0))
    assert (event["trial"], event["source"]) == (low, top)
    r.delete(pop.key(top, "segments"))
    r.rpush(pop.key(top, "segments"), "x")  # not a count: counted from 0 again
    finish(pop, pcfg, top, {"episodic_return": 2.0})
    assert pop.segments(pcfg.trials()) == {low: 2, top: 1}


def test_choose_takes_the_top_for_the_bottom_only():
    scores = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    rng = random.Random(0)
    assert choose("a", scores, 0.25, rng) == "d"
    assert all(choose(t, scores, 0.25, rng) is None for t in "bcd")
    assert choose("a", {"a": 1.0, "b": 1.0}, 0.5, rng) is None  # no better trial
    assert choose("z", scores, 0.25, rng) is None and choose("a", {"a": 1.0}, 0.5, rng) is None
    # past 0.5: every trial below the top 1 - quantile copies one of the top
    assert [choose(t, scores, 0.75, rng) for t in "abcd"] == ["d", "d", "d", None]
    assert {choose("a", scores, 0.5, rng) for _ in range(50)} == {"c", "d"}
    assert choose("c", scores, 0.5, rng) is None
    assert [choose(t, scores, 0.99, rng) for t in "abcd"] == ["d", "d", "d", None]


def test_leases_time_share_and_a_dead_holders_trial_is_taken_back(r, keys):
    pcfg = _pcfg(keys, population=2)
    pop = setup(r, pcfg)
    a = pop.claim("w1", 60, pcfg.trials())
    b = pop.claim("w2", 0.3, pcfg.trials())
    assert {a, b} == set(pcfg.trials()) and pop.claim("w3", 60, pcfg.trials()) is None
    assert not pop.release(a, "w2") and pop.release(a, "w1")  # only its holder gives it back
    assert pop.claim("w3", 60, pcfg.trials()) == a
    # once w2's lease runs out its trial is anyone's
    assert wait_until(lambda: pop.claim("w1", 60, pcfg.trials()), "w2's lease to run out", 10) == b
    assert not pop.renew(b, "w2", 60)
    assert pop.holders(pcfg.trials()) == {a: "w3", b: "w1"}
    # a long segment keeps its trial: its slot renews the lease while it runs
    pop.release(a, "w3")
    assert pop.claim("w4", 0.3, pcfg.trials()) == a
    renew = Renewal(pop, a, "w4", 60)
    renew.next = 0.0
    renew()
    assert r.pttl(pop.key(a, "lease")) > 1000  # renewed past the 0.3 s it was taken for
    assert pop.claim("w5", 60, pcfg.trials()) is None and not renew.lost
    renew = Renewal(pop, a, "w5", 60)  # not its holder: lost
    renew.next = 0.0
    renew()
    assert renew.lost


def test_a_lease_no_worker_could_have_taken_parks_no_trial(r, keys):
    """A writer's lease ending at +inf (or past the longest lease from now) is void: the trial
    is taken at once, and the writer's entry is replaced by a real lease."""
    pcfg = _pcfg(keys, population=2)
    pop = setup(r, pcfg)
    a, b = pcfg.trials()
    r.set(pop.key(a, "lease"), "w0")  # no end
    r.set(pop.key(b, "lease"), "w0", px=MAX_LEASE_MS + 60_000)
    assert {pop.claim("w1", 60, pcfg.trials()), pop.claim("w2", 60, pcfg.trials())} == {a, b}
    assert pop.claim("w3", 60, pcfg.trials()) is None  # their leases now are real ones
    assert max(r.pttl(pop.key(t, "lease")) for t in (a, b)) <= 60_000


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started, from any of its threads."""
    tasks = Path(f"/proc/{pid}/task").glob("*/children")
    return [int(child) for task in tasks for child in task.read_text().split()]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigkilled_workers_trial_goes_on_from_its_last_stored_state(redis_server, keys, tmp_path):
    client = connect(redis_server.url)
    # no exploit: a slot taking a low trial would copy the other one's state (this test
    # follows one trial's own state through its worker's death)
    pcfg = _pcfg(
        keys, ready_s=6.0, lease_s=5.0, target_return=10_000.0, confirm_episodes=0, exploit=False
    )
    pop = setup(client, pcfg)
    env = {**os.environ, "QRL_REDIS_URL": redis_server.url}
    a = subprocess.Popen(
        [sys.executable, "-m", "qrl.cli", "pbt", "worker", keys.run, "--run-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    b = None
    try:

        def saved() -> str | None:  # the trial whose first segment saved its state
            held = list(pop.holders(pcfg.trials()))
            if len(held) == 1 and SnapshotStore(client, RunKeys(held[0])).fetch() is not None:
                return held[0]
            return None

        trial = wait_until(saved, "a's first segment to save its trial's state", 120)
        first = SnapshotStore(client, RunKeys(trial)).fetch().updates
        wait_until(
            lambda: WeightStore(client, RunKeys(trial)).version() > first,
            "its next segment to train",
            120,
            every=0.5,
        )
        slots = _children(a.pid)
        roles = [pid for s in slots for pid in _children(s)]
        assert roles, "no segment's roles under the slots"
        for pid in [a.pid, *slots]:
            os.kill(pid, signal.SIGKILL)
        a.wait(10)
        # the roles stop as their parent died, the learner's save stays there
        wait_until(lambda: not any(map(pid_alive, roles)), "the orphaned roles to stop", 60)
        last = SnapshotStore(client, RunKeys(trial)).fetch()  # the last segment a stored
        assert last.updates == first
        b = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qrl.cli",
                "pbt",
                "worker",
                keys.run,
                "--slots",
                "2",
                "--run-dir",
                str(tmp_path / "b"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        resumed = tmp_path / "b" / trial / "logs" / "learner0.log"
        text = wait_until(
            lambda: resumed.exists() and resumed.read_text(),
            "the trial to resume",
            120,
            until=lambda text: text and "resumed from the run's snapshot" in text,
            every=0.5,
        )
        assert f"resumed from the run's snapshot at update {last.updates}" in text, text[-2000:]
        wait_until(
            lambda: WeightStore(client, RunKeys(trial)).version() > last.updates,
            "the trial to train on",
            120,
            every=0.5,
        )
        b.send_signal(signal.SIGINT)  # to the worker alone: it stops its slots in order
        assert b.wait(30) == 0
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_qrl_pbt_cli_runs_a_population_and_writes_its_lineage(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_URL"}
    proc = qrl(
        "pbt",
        "ppo",
        "--env",
        "CartPole-v1",
        "--population",
        "3",
        "--slots",
        "2",
        "--explore",
        "lr=1e-4..3e-3:log",
        "--ready-steps",
        "20000",
        "--ready",
        "60",
        "--max-time",
        "200",
        "--name",
        "cli-pbt",
        "--run-dir",
        str(tmp_path),
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["solved"]["return"] >= 475
    counts = result["segments"]  # each trial's segments trained, read before Redis stopped
    assert set(counts) == {f"cli-pbt-t{i}" for i in range(3)} and sum(counts.values()) >= 1
    assert (tmp_path / "scores.csv").read_text().startswith("time,trial,score,lr")
    assert (tmp_path / result["solved"]["trial"] / "checkpoint.pt").exists()
    assert (tmp_path / "lineage.jsonl").exists()


def _control(pcfg: PBTConfig, tmp_path, max_time: float = 2.0) -> tuple[int, str]:
    """``qrl pbt``'s controller with no slots for ``max_time`` seconds on the session's Redis:
    its exit code and what it printed (to a terminal: escapes would reach it)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = io.StringIO()
    try:
        code = run_population(
            pcfg,
            redis_url=os.environ["QRL_REDIS_URL"],
            slots=0,
            run_root=tmp_path,
            max_time=max_time,
            console=Console(file=out, force_terminal=True, width=200),
        )
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return code, out.getvalue()


FORGED = {  # pbt:solved (and a worker's claim) as a worker's user may write them
    "not-a-number": {"return": "lots"},  # crashed the controller's print (ValueError)
    "escapes": {"suffix": "\x1b]0;owned\x07\x1b[2J", "return": 500.0},  # printed raw, exit 0
    "plausible": {"return": 500.0},  # ended the population "confirmed", exit 0
}


@pytest.mark.slow
@pytest.mark.parametrize("case", FORGED)
def test_a_forged_solve_neither_crashes_the_controller_nor_ends_it_confirmed(
    r, keys, tmp_path, case
):
    pcfg = _pcfg(keys, eval_episodes=2, confirm_episodes=5)  # target 475
    pop = setup(r, pcfg)
    t0 = pcfg.trials()[0]
    WeightStore(r, RunKeys(t0)).publish(_learner(r, t0).net, 1)  # untrained: far below it
    forged = {"trial": t0 + FORGED[case].get("suffix", ""), "return": FORGED[case]["return"]}
    r.set(pop.solved_key, json.dumps(forged))
    r.set(RunKeys(t0).key("pbt:reached"), json.dumps(forged))
    code, printed = _control(pcfg, tmp_path)
    assert code == 1, printed  # the time ran out: nothing was confirmed
    assert "\x1b]" not in printed and "\x07" not in printed and "\x1b[2J" not in printed
    assert "not confirmed" in printed  # the controller evaluated the claimed trial itself
    assert json.loads((tmp_path / "result.json").read_text())["solved"] is None


def test_pbt_solved_is_read_only_as_a_solve_of_the_populations_trial(r, keys):
    pop = setup(r, _pcfg(keys))
    for bad in (
        "\xff",
        "[1]",
        "x" * 100_000,
        json.dumps({"trial": "other", "return": 1.0}),
        json.dumps({"trial": f"{keys.run}-t0", "return": float("inf")}),
    ):
        r.set(pop.solved_key, bad)
        assert pop.solved() is None
    r.delete(pop.solved_key)
    r.rpush(pop.solved_key, "not a string")
    assert pop.solved() is None


def test_a_claimed_solve_is_confirmed_by_the_controllers_own_evaluation(r, keys, tmp_path):
    pcfg = _pcfg(keys, eval_episodes=2, confirm_episodes=5, target_return=5.0)  # any policy
    pop = setup(r, pcfg)
    t0, t1 = pcfg.trials()
    WeightStore(r, RunKeys(t1)).publish(_learner(r, t1).net, 1)
    finish(pop, pcfg, t1, {"reached": True, "confirm_return": 9.0})  # the worker's claim
    assert pop.solved() is None  # only a claim: the workers go on
    code, printed = _control(pcfg, tmp_path, max_time=60)
    assert code == 0, printed
    solved = json.loads((tmp_path / "result.json").read_text())["solved"]
    assert solved["trial"] == t1 and solved["return"] >= 5.0
    assert pop.solved()["trial"] == t1  # written by the controller: the workers stop


ADMIN = "admin-pw-for-pbt-acl-tests"


def test_a_trials_worker_writes_only_its_trial_and_the_controller_only_the_population(tmp_path):
    from qrl.pbt.acl import as_user, create_users, trial_urls

    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        pcfg = _pcfg(RunKeys("acl-pop"), population=3)
        setup(admin, pcfg)
        t0, t1, t2 = pcfg.trials()
        learner = _learner(admin, t1)
        SnapshotStore(admin, RunKeys(t1)).save(capture(learner.net, learner.opt, 4))
        users = create_users(admin, pcfg, tmp_path / "pw")
        assert sorted(p.name for p in (tmp_path / "pw").iterdir()) == sorted(
            ["controller", t0, t1, t2]
        )
        (tmp_path / "pw" / f"{pcfg.name}-tx").write_text("x\n")  # not a trial's: not taken
        urls = trial_urls(server.address, pcfg.name, tmp_path / "pw")  # qrl pbt worker --acl
        assert list(urls) == [t0, t1, t2]
        assert connect(urls[t2]).acl_whoami() == f"{t2}.worker"
        worker = connect(as_user(server.url, *users[t0]))
        pop = Population(worker, pcfg.name)
        # what a worker of t0 does: its own lease, score, count, lineage, claim, exploit
        assert pop.claim("w", 60, pcfg.trials(), via={t0: pop}) == t0
        pop.post(t0, 1.0)
        pop.trained(t0)
        pop.report_reached(t0, 9.0)
        assert pop.renew(t0, "w", 60) and pop.release(t0, "w")
        assert pop.config() == pcfg and pop.solved() is None
        admin_pop = Population(admin, pcfg.name)
        admin_pop.post(t1, 5.0)
        assert take_better(pop, pcfg, t0, random.Random(0))["source"] == t1  # reads t1's state
        assert SnapshotStore(admin, RunKeys(t0)).fetch().updates == 5
        assert pop.scores(pcfg.trials()) == {t1: 5.0}  # its own was forgotten as it copied
        refused = [
            lambda: pop.post(t1, 1e9),  # another trial's score, lease, state, lineage
            lambda: pop.take(t1, "w", 60),
            lambda: pop.forget(t1),
            lambda: pop.report_reached(t1, 500.0),
            lambda: pop.record({"trial": t1}),
            lambda: worker.set(Population.key(t1, "segments"), 10**6),
            lambda: SnapshotStore(worker, RunKeys(t1)).save(capture(learner.net, learner.opt, 9)),
            lambda: set_live(worker, RunKeys(t2), ALGOS["ppo"].config, {"lr": 0.5}),
            lambda: worker.delete(RunKeys(t2).weights),
            lambda: worker.set(pop.solved_key, json.dumps({"trial": t0, "return": 500.0})),
            lambda: worker.delete(pop.config_key),
            lambda: worker.hset(pop.keys.control, "stop", 1),  # only the controller stops it
            lambda: worker.get("qrl:{other}:config"),
        ]
        for i, attempt in enumerate(refused):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
                pytest.fail(f"attempt {i} was allowed")
        controller = connect(as_user(server.url, *users["controller"]))
        cpop = Population(controller, pcfg.name)
        assert cpop.scores(pcfg.trials()) == {t1: 5.0} and cpop.reports([t0]).keys() == {t0}
        cpop.solve(t0, 500.0)
        controller.hset(cpop.keys.control, "stop", 1)
        for attempt in (
            lambda: cpop.post(t0, 1.0),
            lambda: cpop.take(t0, "c", 60),
            lambda: controller.delete(RunKeys(t0).key("snapshot")),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
    six = redis_binaries().get((6,))
    if six is not None:  # no read-only key patterns: refused, one line naming Redis 7
        with EmbeddedRedis(password=ADMIN, binary=six) as server:
            admin = redis.Redis.from_url(server.url)
            setup(admin, pcfg)
            with pytest.raises(ValueError, match="needs Redis 7"):
                create_users(admin, pcfg, tmp_path / "pw6")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_population_runs_under_its_acl_users(tmp_path):
    import threading

    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        env = {**os.environ, "QRL_REDIS_URL": server.address, "QRL_REDIS_PASSWORD": ADMIN}
        admin = redis.Redis.from_url(server.url)
        seen: set[str] = set()  # the users of the clients connected while it runs
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.2):
                seen.update(c["user"] for c in admin.client_list() if c["name"] != "watch")

        admin.client_setname("watch")
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            proc = qrl(
                "pbt",
                "ppo",
                "--env",
                "CartPole-v1",
                "--population",
                "2",
                "--slots",
                "2",
                "--explore",
                "lr=1e-4..3e-3:log",
                "--ready",
                "40",
                "--target-return",
                "60",
                "--max-time",
                "200",
                "--name",
                "acl-pbt",
                "--run-dir",
                str(tmp_path / "run"),
                "--acl",
                str(tmp_path / "pw"),
                timeout=280,
                env=env,
            )
        finally:
            done.set()
            watcher.join()
        logs = "\n".join(p.read_text() for p in (tmp_path / "run").rglob("*.log"))
        assert proc.returncode == 0, proc.stderr[-3000:] + logs[-3000:]
        assert admin.acl_log() == []  # no command of any process was refused
        assert "NOPERM" not in logs
        assert {"acl-pbt.controller", "acl-pbt-t0.worker", "acl-pbt-t1.worker"} <= seen, seen
        # each process of a segment as its own user, none as its trial's
        assert {"acl-pbt-t0.learner.0", "acl-pbt-t0.actor.0", "acl-pbt-t1.actor.1"} <= seen
        assert admin.acl_users() == ["default"]  # the population's users went with it
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["solved"]["return"] >= 60


def test_a_trials_processes_run_as_users_that_cannot_write_its_records(tmp_path):
    """Each process of a trial's segment has a user of its own, made with the population and
    reached from the trial's password alone (a slot elsewhere holds no other): it may do its
    role's work, but not post the trial's score, lineage, claim or snapshot (the slot's), nor
    take its lease, nor touch another trial. The users go with the population."""
    from qrl.algos.ppo.keys import rollouts
    from qrl.pbt.acl import as_user, create_users, delete_population_users, role_urls

    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        pcfg = _pcfg(RunKeys("acl-roles"))
        setup(admin, pcfg)
        t0, t1 = pcfg.trials()
        users = create_users(admin, pcfg, tmp_path / "pw")
        algo, cfg = ALGOS["ppo"], current(admin, pcfg, t0)
        urls = role_urls(as_user(server.address, *users[t0]), t0, algo, cfg)  # as a slot does
        assert set(urls) == {(r.name, i) for r, i in algo.processes(cfg)}
        actor, learner = connect(urls[("actor", 0)]), connect(urls[("learner", 0)])
        assert (actor.acl_whoami(), learner.acl_whoami()) == (f"{t0}.actor.0", f"{t0}.learner.0")
        assert actor.xadd(rollouts(RunKeys(t0)), {"d": b"x"})  # their roles' work
        net = _learner(admin, t0).net
        assert WeightStore(learner, RunKeys(t0)).publish(net, 3) == 3
        snap = capture(net, _learner(admin, t0).opt, 3)
        for client in (actor, learner):
            _records_refused(client, pcfg, snap)
        delete_population_users(admin, pcfg)
        assert admin.acl_users() == ["default"]


def _records_refused(client: redis.Redis, pcfg: PBTConfig, snap) -> None:
    """``client``, a user of a process of trial 0, may write none of the trial's records (nor
    read another's, nor the population's)."""
    pop, (t0, t1) = Population(client, pcfg.name), pcfg.trials()
    refused = [
        lambda: pop.post(t0, 1e12),  # its own trial's records: the slot's
        lambda: pop.record({"trial": t0, "time": 1.0}),
        lambda: pop.report_reached(t0, 500.0),
        lambda: SnapshotStore(client, RunKeys(t0)).save(snap),
        lambda: pop.forget(t0),
        lambda: client.set(pop.key(t0, "segments"), 10**6),
        lambda: pop.take(t0, "w", 60),
        lambda: client.set(pop.key(t0, "lease"), "w"),
        lambda: pop.post(t1, -1e12),  # another trial's, the population's
        lambda: client.get(pop.key(t1, "score")),
        lambda: client.set(pop.solved_key, json.dumps({"trial": t0, "return": 500.0})),
        lambda: client.get(pop.config_key),
    ]
    for i, attempt in enumerate(refused):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
            pytest.fail(f"attempt {i} of {client.acl_whoami()} was allowed")


@pytest.mark.slow
def test_a_populations_users_go_when_it_ends_or_is_interrupted(tmp_path):
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        env = {**os.environ, "QRL_REDIS_URL": server.address, "QRL_REDIS_PASSWORD": ADMIN}
        args = [
            "pbt",
            "ppo",
            "--env",
            "CartPole-v1",
            "--explore",
            "lr=1e-4..1e-3",
            "--slots",
            "0",
            "--name",
            "gone",
            "--acl",
            str(tmp_path / "pw"),
        ]
        done = qrl(*args, "--max-time", "2", "--run-dir", str(tmp_path / "a"), env=env)
        assert done.returncode == 1, done.stderr  # the time ran out
        assert admin.acl_users() == ["default"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "qrl.cli", *args, "--run-dir", str(tmp_path / "b")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(lambda: proc.poll() is not None or len(admin.acl_users()) > 10, "users")
            assert "gone-t3.actor.0" in admin.acl_users()
            proc.send_signal(signal.SIGINT)  # Ctrl-C
            assert proc.wait(60) == 2, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
        assert admin.acl_users() == ["default"]


@pytest.mark.slow
def test_a_trials_unreadable_config_ends_neither_the_controller_nor_a_worker(r, keys, tmp_path):
    """A trial's worker's user owns its trial's run keys, its config too: what it writes
    there leaves the trial's values unknown and the trial uncopied, nothing more."""
    pcfg, pop, low, top = _scored(r, keys)
    learner = _learner(r, top)
    SnapshotStore(r, RunKeys(top)).save(capture(learner.net, learner.opt, 8))
    follow = Follower(pcfg, tmp_path, every=0.0)
    for garbage in (b"not a config", None, "list"):
        r.delete(RunKeys(top).config)
        if garbage == "list":
            r.rpush(RunKeys(top).config, "x")
        elif garbage is not None:
            r.set(RunKeys(top).config, garbage)
        pop.post(top, 2.0 + len(str(garbage)))  # a new score: a new row
        follow(r, pop)  # raised RunUnreadable / RunNotFound in the controller
        assert take_better(pop, pcfg, low, random.Random(0)) is None  # and in a worker
    rows = (tmp_path / "scores.csv").read_text().splitlines()
    assert rows[-1].split(",")[1:] == [top, "6.0", "", ""]
    assert qrl("status", "--run", keys.run).returncode == 0


def test_a_segments_record_refused_by_a_busy_redis_is_lost_not_the_slot(tmp_path, caplog):
    import threading

    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        pcfg = _pcfg(RunKeys("busy"))
        pop = setup(admin, pcfg)
        t0 = pcfg.trials()[0]
        admin.set(pop.key(t0, "segments"), 3)
        admin.config_set("lua-time-limit", 50)  # BUSY to others after 50 ms of a script

        def spin() -> None:
            with contextlib.suppress(redis.ResponseError):  # ended by SCRIPT KILL
                redis.Redis.from_url(server.url).eval("while true do end", 0)

        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            wait_until(lambda: _busy(admin), "Redis to answer BUSY")
            for result in ({"episodic_return": 5.0}, {"reached": True, "confirm_return": 9.0}):
                finish(pop, pcfg, t0, result)  # raised ResponseError BUSY out of the slot
        finally:
            admin.script_kill()
            spinner.join()
        assert caplog.text.count("record is lost") == 1  # one warning, not one per segment
        assert pop.segments([t0]) == {t0: 3}  # the count was not reset by the refusal
        finish(pop, pcfg, t0, {"episodic_return": 5.0})
        assert pop.scores([t0]) == {t0: 5.0} and pop.segments([t0]) == {t0: 4}


def _busy(client: redis.Redis) -> bool:
    try:
        client.get("x")
    except redis.ResponseError as e:
        return str(e).startswith("BUSY")
    return False


def test_a_populations_trials_keys_work_across_a_clusters_slots(redis_cluster):
    """Each trial's keys carry its own hash tag: a population spans a cluster's slots, and
    every call touches one trial's slot at a time."""
    client = connect(redis_cluster.url)
    pcfg = _pcfg(RunKeys("clu"), population=4)
    pop = setup(client, pcfg)
    trials = pcfg.trials()
    assert {pop.claim(f"w{i}", 60, trials) for i in range(4)} == set(trials)
    assert pop.claim("w9", 60, trials) is None
    for trial, worker in pop.holders(trials).items():
        assert pop.renew(trial, worker, 60) and pop.release(trial, worker)
    pop.post(trials[0], 3.0)
    pop.trained(trials[0])
    pop.record({"trial": trials[1], "time": 1.0})
    pop.report_reached(trials[2], 9.0)
    pop.solve(trials[0], 500.0)
    assert pop.scores(trials) == {trials[0]: 3.0} and pop.segments(trials)[trials[0]] == 1
    assert pop.lineage(trials)[0]["trial"] == trials[1] and set(pop.reports(trials)) == {trials[2]}
    assert pop.solved()["trial"] == trials[0]


@pytest.mark.slow
def test_qrl_pbt_acl_refusals_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = qrl("pbt", "worker", "pop", "--acl", str(tmp_path / "empty"))
    assert proc.returncode == 1 and "no password file of a trial of pop" in proc.stderr
    six = redis_binaries().get((6,))
    if six is None:
        return
    env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_URL"}
    proc = qrl(
        "pbt",
        "ppo",
        "--env",
        "CartPole-v1",
        "--explore",
        "lr=1e-4..1e-3",
        "--slots",
        "0",
        "--run-dir",
        str(tmp_path / "run"),
        "--acl",
        str(tmp_path / "pw"),
        env={**env, "QRL_REDIS_SERVER": six},
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("Error: --acl needs Redis 7"), proc.stderr
    assert not (tmp_path / "pw").exists()  # no password was made for users never created
