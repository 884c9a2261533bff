"""Evaluation: play whole episodes with a fixed policy and report the mean return."""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import numpy as np

from qrl.envs import make_env


def evaluate(
    env_id: str,
    policy: Callable[[np.ndarray], np.ndarray],
    episodes: int = 10,
    seed: int = 10_000,
    max_steps: int = 100_000,
) -> list[float]:
    """Run ``episodes`` episodes in parallel (one env each, seeds ``seed + i``) with
    ``policy`` (a batch of observations -> a batch of actions); returns their returns."""
    envs = gym.vector.SyncVectorEnv(
        [lambda: make_env(env_id) for _ in range(episodes)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    try:
        obs, _ = envs.reset(seed=[seed + i for i in range(episodes)])
        returns = np.zeros(episodes)
        done = np.zeros(episodes, dtype=bool)
        for _ in range(max_steps):
            obs, reward, term, trunc, _ = envs.step(policy(obs))
            returns += np.where(done, 0.0, reward)
            done |= term | trunc
            if done.all():
                break
        return returns.tolist()
    finally:
        envs.close()
