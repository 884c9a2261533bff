import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from qrl.actors.dqn import epsilons
from qrl.actors.replay import NStep
from qrl.algos.apex.config import ApexConfig
from qrl.replay.role import make_replay
from qrl.runtime.checkpoint import CheckpointError, load_checkpoint
from qrl.runtime.control import request_stop
from qrl.runtime.loop import run_role
from qrl.runtime.runs import create_run
from qrl.wire.weights import WeightStore
from tests.cli import ROOT, eval_confirmation, qrl, train
from tests.helpers import (
    experience,
    fill_replay,
    kill_feed_mid_run,
    make_actor,
    make_learner,
    not_none,
    skip_or_fail,
    wait_until,
)


def test_nstep_returns_match_the_definition():
    gamma, n = 0.9, 3
    ns = NStep(1, n, gamma)
    rewards = [1.0, 2.0, 3.0, 4.0, 5.0]
    out = []
    for t, r in enumerate(rewards):
        term = np.array([t == len(rewards) - 1])
        out += ns.add(
            np.array([[t]]),
            np.array([t % 2]),
            np.array([r]),
            np.array([[t + 1]]),
            term,
            np.array([False]),
        )
    assert [int(o[0][0]) for o in out] == [0, 1, 2, 3, 4]
    for o, a, ret, disc, nxt in out:
        t = int(o[0])
        horizon = min(n, len(rewards) - t)
        assert ret == pytest.approx(sum(gamma**k * rewards[t + k] for k in range(horizon)))
        assert int(nxt[0]) == t + horizon
        terminal = t + horizon == len(rewards)
        assert disc == pytest.approx(0.0 if terminal else gamma**horizon)
        assert a == t % 2


def test_nstep_truncation_bootstraps():
    ns = NStep(2, 3, 0.5)
    out = ns.add(
        np.zeros((2, 1)),
        np.zeros(2),
        np.ones(2),
        np.ones((2, 1)),
        np.array([False, True]),
        np.array([True, False]),
    )
    by_disc = sorted(o[3] for o in out)
    assert by_disc == [0.0, 0.5]  # terminated: no bootstrap; truncated: gamma^1


def test_per_actor_epsilons_follow_the_paper():
    cfg = ApexConfig(actors=2, envs_per_actor=4)
    eps = np.concatenate([epsilons(cfg, 0), epsilons(cfg, 1)])
    n = 8
    expected = 0.4 ** (1 + np.arange(n) * 7 / (n - 1))
    np.testing.assert_allclose(eps, expected)
    assert eps[0] == pytest.approx(0.4) and eps[-1] == pytest.approx(0.4**8)


def test_a_live_config_change_sets_the_actors_epsilons_again(r, keys):
    cfg = ApexConfig(actors=2, envs_per_actor=4)
    create_run(r, keys, "apex", cfg)
    actor = make_actor("apex", r, keys, cfg, 1)
    np.testing.assert_array_equal(actor.policy.eps, epsilons(cfg, 1))
    live = cfg.model_copy(update={"eps_base": 0.2})
    actor.reconfigure(live)
    assert actor.cfg is live
    np.testing.assert_array_equal(actor.policy.eps, epsilons(live, 1))
    assert (actor.policy.eps < epsilons(cfg, 1)).all()  # a lower base: lower epsilons


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("apex") / "run"
    result = train(
        "apex",
        run_dir,
        "--env",
        "CartPole-v1",
        "--seed",
        "2",  # seed 0's untrained network can already balance: it would learn nothing
        "--target-return",
        "200",
        "--max-time",
        "120",
    )
    return result, run_dir


@pytest.mark.slow
def test_train_apex_cli_learns_cartpole(cartpole_run):
    result, run_dir = cartpole_run
    assert result["reached"] and result["eval_return"] >= 200  # random play scores ~22
    assert result["updates"] > 0 and result["env_steps"] > 0
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("time_s,env_steps") and len(rows) > 3
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algo"] == "apex" and config["config"]["env"] == "CartPole-v1"
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert logs >= {"learner.log", "replay0.log", "actor0.log"}
    # the actors run nicer than the rest (qrl train --actor-nice, 10 by default)
    base = os.nice(0)
    for name, nice in (("learner", base), ("replay0", base), ("actor0", base + 10)):
        assert f"(nice {min(nice, 19)})" in (run_dir / "logs" / f"{name}.log").read_text()


@pytest.mark.slow
def test_eval_plays_the_saved_checkpoint(cartpole_run):
    _, run_dir = cartpole_run
    ckpt = run_dir / "checkpoint.pt"
    state = load_checkpoint(ckpt, "apex", ApexConfig(seed=2))
    assert state["step"] > 0
    eval_confirmation(run_dir)
    with pytest.raises(CheckpointError, match="different configuration"):
        load_checkpoint(ckpt, "apex", ApexConfig(seed=2, n_step=5))
    # fields `qrl run set` may change may differ: the learner takes the run's
    assert load_checkpoint(ckpt, "apex", ApexConfig(seed=2, lr=0.5))["step"] == state["step"]
    with pytest.raises(CheckpointError, match="not impala"):
        load_checkpoint(ckpt, "impala")


@pytest.mark.slow
def test_a_hand_started_actor_joins_a_running_run(r, keys, redis_server, tmp_path):
    cfg = ApexConfig(actors=1, envs_per_actor=4, learning_starts=200, replay_capacity=50_000)
    create_run(r, keys, "apex", cfg)
    env = {**os.environ, "QRL_REDIS_URL": redis_server.url}
    common = {"cwd": ROOT, "env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    roles = [
        subprocess.Popen([sys.executable, "-m", "qrl.cli", "replay", "--run", keys.run], **common),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qrl.cli",
                "learner",
                "apex",
                "--run",
                keys.run,
                "--checkpoint",
                str(tmp_path / "c.pt"),
            ],
            **common,
        ),
    ]
    try:
        # only the URL (from the environment) and the run name: the config comes from Redis
        actor = qrl(
            "actor",
            "apex",
            "--run",
            keys.run,
            "--id",
            "3",
            "--max-steps",
            "2000",
            env=env,
            timeout=180,
        )
        assert actor.returncode == 0, actor.stderr[-2000:]
        replay = make_replay(r, keys, cfg)
        stats = wait_until(
            replay.stats, "the replay to take them in", 30, until=lambda s: s["inserted"] >= 1900
        )
        assert stats["size"] == stats["inserted"]
        version = WeightStore(r, keys).version
        wait_until(version, "weights the learner trained on them", 30, until=lambda v: v > 0)
        assert int(r.hget(keys.stats, "env_steps")) >= 2000
    finally:
        request_stop(r, keys)
        for p in roles:
            assert p.wait(30) == 0, p.stderr.read().decode()[-2000:]
    assert (tmp_path / "c.pt").exists()  # the learner checkpoints on exit


@pytest.mark.slow
def test_atari_smoke_uint8_frames_end_to_end(tmp_path):
    if importlib.util.find_spec("ale_py") is None:
        skip_or_fail("needs ale-py (in the test extra)")
    run_dir = tmp_path / "pong"
    proc = qrl(
        "train",
        "apex",
        "--env",
        "ALE/Pong-v5",
        "--actors",
        "1",
        "--max-time",
        "20",  # ~400 updates here, at least one evaluation
        "--target-return",
        "21",
        "--eval-every",
        "10",
        "--eval-episodes",
        "1",
        "--set",
        "envs_per_actor=2",
        "--set",
        "replay_capacity=2000",
        "--set",
        "learning_starts=64",
        "--set",
        "batch_size=8",
        "--set",
        "actor_batch=32",
        "--set",
        "steps_per_update=8",
        "--run-dir",
        str(run_dir),
        timeout=240,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # budget ran out (not an error: 2)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["updates"] > 0 and result["replay_size"] > 64
    state = load_checkpoint(run_dir / "checkpoint.pt", "apex")
    assert state["model"]["features.1.0.weight"].shape == torch.Size([32, 4, 8, 8])  # Nature conv


@pytest.mark.slow
def test_restarted_learner_resumes_from_its_checkpoint(r, keys, redis_server, tmp_path):
    cfg = ApexConfig(learning_starts=100, publish_every=5)
    create_run(r, keys, "apex", cfg)
    replay = make_replay(r, keys, cfg)
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((500, 4)).astype(np.float32)
    fill_replay(replay, obs, rng.integers(0, 2, 500), disc=np.full(500, 0.97))
    ckpt = tmp_path / "learner.pt"
    env = {**os.environ, "QRL_REDIS_URL": redis_server.url}

    def learn_30() -> int:
        """Run ``qrl learner apex`` for 30 updates; returns the checkpoint's step."""
        out = qrl(
            "learner",
            "apex",
            "--run",
            keys.run,
            "--checkpoint",
            str(ckpt),
            "--max-updates",
            "30",
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return load_checkpoint(ckpt, "apex", cfg)["step"]

    for expected in (30, 60):
        assert learn_30() == expected
        assert WeightStore(r, keys).version() == expected  # versions continue, never repeat
    # killed after publishing past its last checkpoint: the restart continues from Redis
    store = WeightStore(r, keys)
    store.publish(store.fetch().params, version=100)
    assert learn_30() == 130 and store.version() == 130


def test_learner_fails_loudly_when_its_sampler_dies(r, keys, redis_server):
    cfg = ApexConfig(learning_starts=100)
    create_run(r, keys, "apex", cfg)
    replay = make_replay(r, keys, cfg)
    fill_replay(replay, np.zeros((200, 4), np.float32))
    lrn = make_learner(redis_server.url, keys, cfg)
    # it trains on what the sampler sends, then stops naming the sampler
    assert "sampler process (exit code -9)" in kill_feed_mid_run(lrn, r, keys, 20)


def test_a_batch_skipped_for_a_non_finite_loss_is_not_drawn_forever(r, keys, redis_server):
    """Issue 12, finding 4: transitions whose returns overflow the loss (~3e38) kept the top
    priority, so every later batch drew them again and every update was skipped. A skipped
    batch now goes to the replay's lowest priority, and the learner makes progress."""
    import threading

    from qrl.replay.store import P_HI, P_LO

    cfg = ApexConfig(learning_starts=100, batch_size=32)
    create_run(r, keys, "apex", cfg)
    replay = make_replay(r, keys, cfg)
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((300, 4)).astype(np.float32)
    ret = np.ones(300, np.float32)
    ret[:16] = 3.3e38  # stored before the schema bounded returns: two overflow a batch's loss
    prio = np.where(ret > 1, P_HI, 1.0)
    fill_replay(replay, obs, ret=ret, disc=np.full(300, 0.9), priority=prio)
    lrn = make_learner(redis_server.url, keys, cfg)
    t = threading.Thread(target=run_role, args=(lrn, r, keys, 0, lambda: False), daemon=True)
    t.start()
    try:
        wait_until(lambda: lrn.updates, "50 updates", 60, until=lambda u: u >= 50, every=0.05)
    finally:
        lrn.stopping.set()
        t.join(30)
    assert lrn.skipped >= 1  # skipped some, then went on
    # exactly what happens to a skipped batch: its transitions sink to the lowest priority
    lrn.source.start(lrn.fail)
    b = wait_until(lambda: lrn.source.next(1.0, 0), "a batch", until=not_none, every=0)
    b.ret[:] = float("inf")
    assert np.isnan(lrn.train(b))  # the update, then the slot goes back with its priorities
    lrn.source.stop()  # writes the priorities given back so far
    assert set(r.zmscore(keys.replay_priorities, b.ids)) == {P_LO}


def test_experience_with_returns_beyond_the_bound_is_rejected():
    from qrl.algos.apex_family.messages import experience_schema
    from qrl.rl.fields import VALUE_BOUND
    from qrl.wire.codec import CodecError, decode, encode

    schema = experience_schema((4,), "float32", 2, max_rows=8)
    obs = np.zeros((8, 4), np.float32)
    msg = experience(obs, np.zeros(8, np.int32), ret=np.full(8, VALUE_BOUND, np.float32))
    assert decode(encode("apex.experience", msg), schema)["ret"][0] == VALUE_BOUND
    for name, bad, reason in (
        ("ret", np.full(8, 3e38, np.float32), "'ret' has values out of"),
        ("priority", np.full(8, 3e38, np.float32), "'priority' has values out of"),
        ("obs", np.full((8, 4), -3e38, np.float32), "'obs' has values out of"),
        ("action", np.full(8, 2, np.int32), "'action' has values out of"),
    ):
        with pytest.raises(CodecError, match=reason):
            decode(encode("apex.experience", {**msg, name: bad}), schema)
    big = {k: np.concatenate([v, v]) if isinstance(v, np.ndarray) else v for k, v in msg.items()}
    with pytest.raises(CodecError, match="16 transitions, expected 1 to 8"):
        decode(encode("apex.experience", big), schema)
