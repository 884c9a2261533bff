"""``qrl.load_policy``: a trained policy from Python, as SB3 users write ``DQN.load(path)``."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import qrl
from qrl.jobs.policy import LoadedPolicy
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import q_network
from qrl.runtime.checkpoint import CheckpointError, load_checkpoint
from tests.cli import train


def _checkpoint_actions(checkpoint: Path, policy: LoadedPolicy, obs: np.ndarray) -> list:
    """The greedy actions of the network in ``checkpoint``, rebuilt here from its tensors:
    Ape-X's Q-network, or ES's tanh MLP from its flat parameters and observation scale."""
    model = load_checkpoint(checkpoint)["model"]
    x = torch.as_tensor(obs, dtype=torch.float32)
    if policy.algo == "apex":
        net = q_network(policy.config, EnvSpec.of(policy.env_id))
        net.load_state_dict(model)
        with torch.no_grad():
            return net(x).argmax(dim=1).tolist()
    theta, sizes = model["theta"], [4, *policy.config.hidden, 2]  # CartPole: 4 in, 2 out
    x = ((x - model["obs_mean"]) / model["obs_std"]).clamp(-5, 5)
    for n, (i, o) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        w, b, theta = theta[: i * o].reshape(i, o), theta[i * o : i * o + o], theta[i * o + o :]
        x = x @ w.float() + b.float()
        x = torch.tanh(x) if n < len(sizes) - 2 else x
    assert theta.numel() == 0  # every parameter used
    return x.argmax(dim=1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["es", "apex"])
def test_load_policy_predicts_one_observation_and_a_batch(algo, tmp_path):
    run_dir = tmp_path / algo
    result = train(
        algo, run_dir, "--target-return", "150", "--confirm-episodes", "20", "--max-time", "120"
    )
    assert result["reached"] and result["confirm_return"] >= 150, result  # random: ~22
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=1)
    # observations a policy meets (random play, a new episode where one ends), and any the
    # space holds
    visited = [obs]
    for _ in range(40):
        obs, _, terminated, truncated, _ = env.step(int(env.action_space.sample()))
        visited.append(obs)
        if terminated or truncated:
            obs, _ = env.reset()
    samples = np.stack([*visited, *(env.observation_space.sample() for _ in range(40))])
    for source in (run_dir, run_dir / "checkpoint.pt"):
        policy = qrl.load_policy(source)
        assert policy.algo == algo and policy.env_id == "CartPole-v1"
        assert policy.config.env == "CartPole-v1"
        action = policy.predict(obs)
        assert np.ndim(action) == 0 and env.action_space.contains(int(action))
        actions = policy.predict(samples, deterministic=True)
        assert actions.shape == (len(samples),)
        # the saved network's own greedy actions, one observation at a time or a batch
        want = _checkpoint_actions(run_dir / "checkpoint.pt", policy, samples)
        assert actions.tolist() == want
        assert [int(policy.predict(o)) for o in samples] == want
        assert len(set(want)) == 2  # both actions: a policy, not a constant
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
