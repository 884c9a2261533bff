"""The env runner every actor steps its envs with, torch or not: the vector envs, their
steps with the final observation of each ended episode, and the episode statistics the
actor reports. The actors of :mod:`qrl.actors.actor` hold one, the env steppers of central
inference (:mod:`qrl.inference.stepper`, no torch) too.

The episode statistics are counted here rather than by gymnasium's
``RecordEpisodeStatistics``: its vector wrapper reports them through the step's info dict
(arrays and masks per step, to be unpacked again for each ended episode), the same sums with
more work on the hot path, and ours need ``info["final_obs"]`` at the same place anyway."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from qrl.rl.envs import make_vector_env
from qrl.rl.envspec import EnvSpec
from qrl.runtime.config import Config


class Step(NamedTuple):
    """What one step of the vector env gave; ``true_next`` holds the final observation of
    the episodes that ended (``next_obs``, the first of the next ones)."""

    next_obs: np.ndarray
    true_next: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray


class EnvRunner:
    """``envs`` (default ``cfg.envs_per_actor``) copies of ``cfg.env`` (seeded by
    ``cfg.seed``, ``actor_id`` and, for an actor with several env batches, ``batch``),
    stepped together; ``obs`` is what they show now.
    ``env`` describes the env (read once, :class:`qrl.rl.envspec.EnvSpec`: given, or read
    from ``cfg.env``)."""

    def __init__(
        self,
        cfg: Config,
        actor_id: int,
        env: EnvSpec | None = None,
        envs: int | None = None,
        batch: int = 0,
    ) -> None:
        self.env = env or EnvSpec.of(cfg.env)
        self.obs_shape, self.obs_dtype = self.env.obs_shape, self.env.obs_dtype
        n = cfg.envs_per_actor if envs is None else envs
        seed = cfg.seed * 10_000 + actor_id * 100 + batch * n  # (batch 0: as ever)
        self.envs = make_vector_env(cfg.env, n, seed=seed)
        self.obs: np.ndarray
        self.steps = 0
        self.ep_return = np.zeros(n)
        self.ep_length = np.zeros(n, dtype=np.int64)
        self.finished: list[tuple[float, int]] = []

    def reset(self) -> np.ndarray:
        """Reset every env; the first observations."""
        self.obs, _ = self.envs.reset()
        return self.obs

    def step(self, actions: np.ndarray) -> Step:
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
        self.obs = next_obs
        return Step(next_obs, true_next, rewards, term, trunc)

    def episodes(self) -> dict[str, Any]:
        """Env steps and the episodes finished since the last report."""
        returns = [r for r, _ in self.finished]
        lengths = [n for _, n in self.finished]
        self.finished = []
        return {"steps": self.steps, "episode_returns": returns, "episode_lengths": lengths}
