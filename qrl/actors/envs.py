"""What every actor that steps vector envs shares, torch or not: the envs, their steps with
the final observation of each ended episode, and the episode statistics it reports. The
actors that hold a network (:class:`qrl.actors.base.VectorActor`) and the env steppers of
central inference (:mod:`qrl.inference.stepper`, no torch) build on it."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from qrl.rl.envs import make_vector_env
from qrl.rl.envspec import EnvSpec
from qrl.runtime.config import Config
from qrl.runtime.loop import Role


class Step(NamedTuple):
    """What one step of the vector env gave; ``true_next`` holds the final observation of
    the episodes that ended (``next_obs``, the first of the next ones)."""

    next_obs: np.ndarray
    true_next: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray


class EnvActor(Role):
    """``envs`` (default ``cfg.envs_per_actor``) copies of ``cfg.env`` (seeded by
    ``cfg.seed`` and ``actor_id``), stepped together; subclasses implement :meth:`step`.
    ``self.env`` describes the env (read once, :class:`qrl.rl.envspec.EnvSpec`: given, or read from
    ``cfg.env``)."""

    name = "actor"
    counter = "steps"

    def __init__(
        self, cfg: Config, actor_id: int, env: EnvSpec | None = None, envs: int | None = None
    ) -> None:
        self.cfg, self.actor_id = cfg, actor_id
        self.env = env or EnvSpec.of(cfg.env)
        self.obs_shape, self.obs_dtype = self.env.obs_shape, self.env.obs_dtype
        n = cfg.envs_per_actor if envs is None else envs
        self.envs = make_vector_env(cfg.env, n, seed=cfg.seed * 10_000 + actor_id * 100)
        self.steps = 0
        self.ep_return = np.zeros(n)
        self.ep_length = np.zeros(n, dtype=np.int64)
        self.finished: list[tuple[float, int]] = []

    def step_envs(self, actions: np.ndarray) -> Step:
        """Step every env."""
        next_obs, rewards, term, trunc, info = self.envs.step(actions)
        ended = term | trunc
        true_next = next_obs
        if ended.any():
            true_next = next_obs.copy()
            for j in np.flatnonzero(ended):
                true_next[j] = info["final_obs"][j]
        self.ep_return += rewards
        self.ep_length += 1
        for j in np.flatnonzero(ended):
            self.finished.append((float(self.ep_return[j]), int(self.ep_length[j])))
            self.ep_return[j], self.ep_length[j] = 0.0, 0
        self.steps += len(actions)
        return Step(next_obs, true_next, rewards, term, trunc)

    def episodes(self) -> dict[str, Any]:
        """Env steps and the episodes finished since the last report."""
        returns = [r for r, _ in self.finished]
        lengths = [n for _, n in self.finished]
        self.finished = []
        return {"steps": self.steps, "episode_returns": returns, "episode_lengths": lengths}
