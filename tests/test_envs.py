"""qrl's registered tasks: the slowed CartPole steps exactly like CartPole-v1, only slower."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

import qrl  # noqa: F401  (registers qrl's tasks)


def test_slow_cartpole_is_cartpole_with_a_sleep_in_every_step():
    slow, fast = gym.make("qrl/SlowCartPole-v1"), gym.make("CartPole-v1")
    assert slow.spec.max_episode_steps == 500 and slow.spec.reward_threshold == 475.0
    assert slow.observation_space == fast.observation_space
    assert slow.action_space == fast.action_space
    assert slow.get_wrapper_attr("sleep_s") == 1e-3  # its 1 ms sleep in every step (SlowStep)
    rng = np.random.default_rng(0)
    for episode in range(3):
        a, _ = slow.reset(seed=episode)
        b, _ = fast.reset(seed=episode)
        assert np.array_equal(a, b)
        done = False
        while not done:
            action = int(rng.integers(2))
            a, ra, ta, ua, _ = slow.step(action)
            b, rb, tb, ub, _ = fast.step(action)
            assert np.array_equal(a, b) and (ra, ta, ua) == (rb, tb, ub)
            done = ta or ua
