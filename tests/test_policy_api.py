"""``qrl.load_policy``: a trained policy from Python, as SB3 users write ``DQN.load(path)``."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import qrl
from qrl.runtime.checkpoint import CheckpointError
from tests.cli import train


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["es", "apex"])
def test_load_policy_predicts_one_observation_and_a_batch(algo, tmp_path):
    run_dir = tmp_path / algo
    train(algo, run_dir, "--target-return", "15", "--max-time", "120", "--eval-every", "1")
    for source in (run_dir, run_dir / "checkpoint.pt"):
        policy = qrl.load_policy(source)
        assert policy.algo == algo and policy.env_id == "CartPole-v1"
        assert policy.config.env == "CartPole-v1"
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=1)
        action = policy.predict(obs)
        assert np.ndim(action) == 0 and env.action_space.contains(int(action))
        batch = np.stack([env.observation_space.sample() for _ in range(7)])
        actions = policy.predict(batch, deterministic=True)
        assert actions.shape == (7,) and all(env.action_space.contains(int(a)) for a in actions)
        assert actions[0] == policy.predict(batch[0])  # greedy: the same observation, the same act
    with pytest.raises(ValueError, match="greedily"):
        policy.predict(obs, deterministic=False)
    with pytest.raises(ValueError, match="observation shape"):
        policy.predict(np.zeros(3))


def test_load_policy_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        qrl.load_policy(tmp_path)
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError):
        qrl.load_policy(bad)
