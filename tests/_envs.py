"""Envs registered for tests:

* ``QrlTestPendulum-v0``: registered without a reward threshold, for ``qrl train --env
  tests._envs:ID`` (Pendulum's dynamics under another id: qrl's own table gives Pendulum-v1
  a target).
* ``QrlCountedCartPole-v0`` and ``QrlCountedPendulum-v0``: CartPole-v1 and Pendulum-v1 that
  count every instance made in :data:`made`, to see which code makes envs (and how many)."""

from __future__ import annotations

import gymnasium as gym
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from gymnasium.envs.classic_control.pendulum import PendulumEnv

NO_THRESHOLD = "QrlTestPendulum-v0"
COUNTED_CARTPOLE = "QrlCountedCartPole-v0"
COUNTED_PENDULUM = "QrlCountedPendulum-v0"

made = 0  # instances of the counted envs made in this process


class CountedCartPole(CartPoleEnv):
    def __init__(self, **kwargs: object) -> None:
        global made
        made += 1
        super().__init__(**kwargs)  # type: ignore[arg-type]


class CountedPendulum(PendulumEnv):
    def __init__(self, **kwargs: object) -> None:
        global made
        made += 1
        super().__init__(**kwargs)  # type: ignore[arg-type]


for _id, _entry, _steps in (
    (NO_THRESHOLD, "gymnasium.envs.classic_control.pendulum:PendulumEnv", 200),
    (COUNTED_CARTPOLE, "tests._envs:CountedCartPole", 500),
    (COUNTED_PENDULUM, "tests._envs:CountedPendulum", 200),
):
    if _id not in gym.registry:
        gym.register(_id, entry_point=_entry, max_episode_steps=_steps)
