"""The Ape-X DPG actor: the Ape-X actor (vector envs, n-step returns, shards, pushing,
throttling: :class:`qrl.actors.replay.TransitionActor`) with a deterministic policy plus Gaussian
exploration noise, one sigma per env slot spread like Ape-X's epsilons, actions scaled to
the Box's bounds and clipped there.

Actors hold only the actor network (the learner publishes nothing else), so they cannot
compute a TD error: a new transition gets ``initial_priority``, above the learner's TD
errors, so it is sampled soon and then carries its |TD error| (prioritized replay's
"new transitions at the maximal priority", Schaul et al. 2016)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qrl.actors.replay import TransitionActor, spread
from qrl.algos.apex_dpg.dpg import explore, policy_net, scale_action
from qrl.rl.envspec import EnvSpec


class ApexDPGActor(TransitionActor):
    action_dtype: Any = np.float32

    def action_size(self, env: EnvSpec) -> int:
        self.low, self.high = env.box_actions()
        return len(self.low)

    def make_net(self) -> torch.nn.Module:
        return policy_net(self.obs_shape, self.n_actions, self.cfg.hidden)

    def explore(self) -> None:
        self.sigma = spread(self.cfg.noise_base, self.cfg.noise_alpha, self.cfg, self.actor_id)

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> np.ndarray:
        a = self.net["actor"](torch.from_numpy(np.asarray(obs))).numpy()
        return scale_action(explore(a, self.sigma, self.rng), self.low, self.high)

    def priorities(
        self, obs: np.ndarray, act: np.ndarray, ret: np.ndarray, disc: np.ndarray, nxt: np.ndarray
    ) -> np.ndarray:
        return np.full(len(ret), self.cfg.initial_priority, np.float32)
