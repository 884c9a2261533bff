"""An env registered without a reward threshold, for ``qrl train --env tests._envs:ID``
(Pendulum's dynamics under another id: qrl's own table gives Pendulum-v1 a target)."""

from __future__ import annotations

import gymnasium as gym

NO_THRESHOLD = "QrlTestPendulum-v0"

if NO_THRESHOLD not in gym.registry:
    gym.register(
        NO_THRESHOLD,
        entry_point="gymnasium.envs.classic_control.pendulum:PendulumEnv",
        max_episode_steps=200,
    )
