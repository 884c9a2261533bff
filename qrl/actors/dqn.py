"""The DQN actor of Ape-X and Gorila (:class:`qrl.actors.replay.TransitionActor`): batched
epsilon-greedy inference with Ape-X's per-slot epsilons, and initial priorities from the
actor's own |TD error| under its copy of the Q-network."""

from __future__ import annotations

import numpy as np
import torch

from qrl.actors.replay import TransitionActor, spread
from qrl.algos.apex_family.config import ReplayConfig
from qrl.rl.models import q_network


def epsilons(cfg: ReplayConfig, actor_id: int) -> np.ndarray:
    """Ape-X exploration: eps_i = eps^(1 + i * alpha / (N - 1)) (:func:`spread`), from a
    config's ``eps_base`` and ``eps_alpha`` (its ``QLearning`` part: Ape-X's, Gorila's)."""
    return spread(cfg.eps_base, cfg.eps_alpha, cfg, actor_id)


class DQNActor(TransitionActor):
    action_dtype = np.int32

    def make_net(self) -> torch.nn.Module:
        return q_network(self.cfg, self.env)

    def explore(self) -> None:
        self.eps = epsilons(self.cfg, self.actor_id)

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> np.ndarray:
        q = self.net(torch.from_numpy(np.asarray(obs)))
        greedy = q.argmax(dim=1).numpy()
        explore = self.rng.random(len(greedy)) < self.eps
        random = self.rng.integers(0, self.n_actions, len(greedy))
        return np.where(explore, random, greedy)

    @torch.no_grad()
    def priorities(
        self, obs: np.ndarray, act: np.ndarray, ret: np.ndarray, disc: np.ndarray, nxt: np.ndarray
    ) -> np.ndarray:
        """|TD error| of the n-step double-Q target under the actor's own network."""
        q = self.net(torch.from_numpy(obs))
        q_next = self.net(torch.from_numpy(nxt))
        best = q_next.max(dim=1).values.numpy()
        q_sa = q.gather(1, torch.from_numpy(act.astype(np.int64))[:, None])[:, 0].numpy()
        return np.abs(ret + disc * best - q_sa).astype(np.float32)
