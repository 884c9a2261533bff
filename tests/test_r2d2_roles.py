"""R2D2's roles against a real Redis: the learner's priority writes, hand-started roles,
a whole `qrl train r2d2` run, `load_policy`'s LSTM state, and a corpus of malformed
sequences against a running filler."""

import json
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

from qrl.algos.r2d2.config import R2D2Config
from qrl.algos.r2d2.rule import (
    sequence_priority,
    sequence_td,
)
from qrl.replay.role import make_replay
from qrl.replay.sequences import SequenceFiller, max_rows, sequence_spec
from qrl.rl.envspec import EnvSpec
from qrl.runtime.control import request_stop
from qrl.runtime.runs import create_run
from qrl.wire.codec import encode
from qrl.wire.weights import WeightStore
from tests.cli import ROOT, eval_confirmation, qrl, train
from tests.helpers import (
    experience,
    make_learner,
    not_none,
    random_sequences,
    sequence_message,
    wait_until,
)

LSTM = 8


def test_learner_writes_the_priority_mix_back(r, keys, redis_server):
    cfg = R2D2Config(
        sequence_length=6,
        lstm=LSTM,
        hidden=(8,),
        learning_starts=10,
        batch_size=8,
        overlap=2,
        burn_in=2,
    )
    create_run(r, keys, "r2d2", cfg)
    layout, _ = sequence_spec(cfg, EnvSpec.of(cfg.env))
    batch = random_sequences(np.random.default_rng(5), 40, 6, obs_dim=2)
    make_replay(r, keys, cfg, layout=layout).insert(layout.pack_columns(**batch), np.ones(40))
    lrn = make_learner(redis_server.url, keys, cfg)
    lrn.source.start(lrn.fail)
    try:
        b = wait_until(lambda: lrn.source.next(1.0, 0), "a batch", until=not_none, every=0)
        rule = lrn.rule
        with torch.no_grad():
            q, y, mask = sequence_td(rule.net, rule.target, b.seq, rule.sequences)
            want = sequence_priority(y - q, mask, 0.9).numpy()
            given = rule.loss(b, 0).priorities  # returned by the loss, for the replay
        np.testing.assert_allclose(given.numpy(), want, rtol=1e-5, atol=1e-6)
        assert np.isfinite(lrn.train(b))  # the update, then the slot back with the priorities
    finally:
        lrn.source.stop()
    got = np.array(r.zmscore(keys.replay_priorities, b.ids))
    np.testing.assert_allclose(got, np.maximum(want + 1e-6, 1e-6), rtol=1e-4)


@pytest.mark.slow
def test_hand_started_roles_fill_the_replay_with_sequences(r, keys, redis_server, tmp_path):
    """qrl replay, qrl learner r2d2 and qrl actor r2d2 joining a run by name; qrl status
    shows the replay of sequences; the learner checkpoints on exit."""
    cfg = R2D2Config(actors=1, envs_per_actor=4, learning_starts=400, sequence_length=10, overlap=5)
    create_run(r, keys, "r2d2", cfg)
    env = {**os.environ, "QRL_REDIS_URL": redis_server.url}
    common = {"cwd": ROOT, "env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    cli = [sys.executable, "-m", "qrl.cli"]
    ckpt = tmp_path / "c.pt"
    roles = [
        subprocess.Popen([*cli, "replay", "--run", keys.run], **common),
        subprocess.Popen(
            [*cli, "learner", "r2d2", "--run", keys.run, "--checkpoint", str(ckpt)], **common
        ),
    ]
    try:
        actor = qrl("actor", "r2d2", "--run", keys.run, "--max-steps", "3000", env=env, timeout=180)
        assert actor.returncode == 0, actor.stderr[-2000:]
        wait_until(lambda: WeightStore(r, keys).version() > 0, "the learner's weights", 30)
        layout, _ = sequence_spec(cfg, EnvSpec.of(cfg.env))
        replay = make_replay(r, keys, cfg, layout=layout)
        wait_until(lambda: r.xlen(keys.experience) == 0, "the filler to take all in", 30)
        size = replay.size()
        # each env step is new in exactly one sequence: all of an episode's first sequence,
        # the steps past the overlap of every later one; the actor's 3000 steps are there
        # but those still in its sequencer (fewer than sequence_length per env slot)
        seqs = layout.unpack(r.hvals(keys.replay_data))
        assert len(seqs) == size and (seqs["steps"] <= cfg.sequence_length).all()
        new = seqs["steps"] - np.where(seqs["first"], 0, cfg.overlap)
        assert (new >= 1).all()
        assert 3000 - cfg.envs_per_actor * (cfg.sequence_length - 1) < new.sum() <= 3000
        status = qrl("status", "--run", keys.run, "--json", env=env, timeout=60)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["replay_size"] == size
    finally:
        request_stop(r, keys)
        for p in roles:
            assert p.wait(30) == 0, p.stderr.read().decode()[-2000:]
    assert ckpt.exists()


@pytest.fixture(scope="module")
def novel_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("r2d2") / "run"
    result = train(
        "r2d2",
        run_dir,
        "--seed",
        "0",
        "--target-return",
        "150",
        "--max-time",
        "120",
        "--confirm-episodes",
        "20",
    )
    return result, run_dir


@pytest.mark.slow
def test_train_r2d2_learns_cartpole_without_velocities(novel_run):
    result, run_dir = novel_run
    assert result["reached"] and result["eval_return"] >= 150, result  # random play: ~22
    assert result["confirm_return"] >= 150 and result["updates"] > 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algo"] == "r2d2" and config["config"]["env"] == "qrl/CartPoleNoVel-v1"
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert logs >= {"learner.log", "replay0.log", "actor0.log"}
    eval_confirmation(run_dir)


@pytest.mark.slow
def test_load_policy_keeps_the_lstm_state_between_calls(novel_run):
    import qrl as qrl_api

    _, run_dir = novel_run
    policy = qrl_api.load_policy(run_dir)
    assert policy.algo == "r2d2" and policy.observation_shape == (2,)
    recurrent = policy.act  # the checkpoint's LSTM Q-network and the state it carries
    env = gym.make("qrl/CartPoleNoVel-v1")
    total = 0.0
    for episode in range(3):
        policy.reset()
        assert recurrent.state is None  # zeros at the next call
        obs, _ = env.reset(seed=100 + episode)
        seen, actions, done = [], [], False
        while not done:
            seen.append(obs)
            actions.append(int(policy.predict(obs)))
            obs, reward, term, trunc, _ = env.step(actions[-1])
            total += reward
            done = term or trunc
        # step by step, predict acted as the network does on the whole episode at once from
        # zeros, and holds the state the network ends it in
        with torch.no_grad():
            q, (h, c) = recurrent.net(torch.as_tensor(np.stack(seen))[None])
        assert actions == q[0].argmax(dim=1).tolist()
        assert h.abs().max() > 0.01 and c.abs().max() > 0.01  # not the zeros of a reset
        torch.testing.assert_close(recurrent.state, (h, c), rtol=1e-4, atol=1e-5)
    assert total / 3 > 100


def test_the_filler_dead_letters_a_corpus_of_malformed_sequences(r, keys):
    """Every malformed category of tests/corpus.py (bombs, flipped bits, wrong shapes,
    dtypes, NaN, another algorithm's valid message...) against a live SequenceFiller: each
    is rejected once and acknowledged; only the valid sequences reach the replay."""
    from tests.corpus import corpus

    cfg = R2D2Config(sequence_length=5, overlap=2, burn_in=2, lstm=LSTM)
    create_run(r, keys, "r2d2", cfg)
    filler = SequenceFiller(r, keys, cfg)
    good = random_sequences(np.random.default_rng(6), 4, 5, obs_dim=2)
    obs = np.zeros((2, 2), np.float32)
    other = encode("apex.experience", experience(obs, np.zeros(2, np.int32), batch="x"))
    _, schema = sequence_spec(cfg, EnvSpec.of(cfg.env), max_rows(cfg))
    n = 0
    for _, payload in corpus("r2d2.sequences", sequence_message(good), schema, other, 300):
        r.xadd(keys.experience, {"d": payload})
        n += 1
    r.xadd(keys.experience, {"d": encode("r2d2.sequences", sequence_message(good))})
    wait_until(
        lambda: (filler.consumer.rejected, filler.inserted),
        "the filler to take in or reject every entry",
        120,
        until=lambda got: got[0] + got[1] // 4 >= n + 1,
        between=lambda: filler.step(lambda: False),
        every=0,
    )
    filler.close(lambda: False)
    assert filler.consumer.rejected == n and filler.inserted == 4
    assert r.zcard(keys.replay_priorities) == 4 and r.xlen(keys.experience) == 0
