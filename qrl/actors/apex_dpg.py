"""The Ape-X DPG actor's policy and priorities, for the Ape-X actor's other parts (vector
envs, n-step returns, shards, pushing, throttling: :mod:`qrl.actors.replay`): a
deterministic policy plus Gaussian exploration noise, one sigma per env slot spread like
Ape-X's epsilons, actions scaled to the Box's bounds and clipped there (:class:`NoisyDPG`).

Actors hold only the actor network (the learner publishes nothing else), so they cannot
compute a TD error: a new transition gets ``initial_priority`` (:func:`initial_priorities`),
above the learner's TD errors, so it is sampled soon and then carries its |TD error|
(prioritized replay's "new transitions at the maximal priority", Schaul et al. 2016)."""

from __future__ import annotations

import numpy as np
import torch

from qrl.actors.actor import Policy
from qrl.actors.replay import spread
from qrl.algos.apex_dpg.config import ApexDPGConfig
from qrl.algos.apex_dpg.dpg import explore, scale_action
from qrl.runtime.loop import StopCheck


class NoisyDPG(Policy):
    """``net``'s (``policy_net``) actions plus each env slot's Gaussian noise (drawn from
    the actor's own generator, seeded by ``cfg.seed`` and ``actor_id``), scaled to the
    Box's bounds ``low``, ``high``."""

    def __init__(
        self,
        net: torch.nn.Module,
        cfg: ApexDPGConfig,
        actor_id: int,
        low: np.ndarray,
        high: np.ndarray,
    ) -> None:
        self.net, self.actor_id, self.low, self.high = net, actor_id, low, high
        self.rng = np.random.default_rng(cfg.seed * 10_000 + actor_id)
        self.reconfigure(cfg)

    def reconfigure(self, cfg: ApexDPGConfig) -> None:
        self.sigma = spread(cfg.noise_base, cfg.noise_alpha, cfg, self.actor_id)

    @torch.no_grad()
    def act(self, obs: np.ndarray, should_stop: StopCheck) -> tuple[np.ndarray, None]:
        a = self.net["actor"](torch.from_numpy(np.asarray(obs))).numpy()
        return scale_action(explore(a, self.sigma, self.rng), self.low, self.high), None


def initial_priorities(
    priority: float,
    obs: np.ndarray,
    act: np.ndarray,
    ret: np.ndarray,
    disc: np.ndarray,
    nxt: np.ndarray,
) -> np.ndarray:
    """``priority`` for every new transition."""
    return np.full(len(ret), priority, np.float32)
