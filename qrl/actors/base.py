"""What every vector-env actor that acts with its own network shares: the envs and episode
statistics (:class:`qrl.actors.envs.EnvActor`) and a local copy of the learner's network
kept fresh from the weight store. Each subclass pushes through its own bounded producers (one
stream, or one per replay shard)."""

from __future__ import annotations

from typing import Any

import numpy as np
import redis
import torch

from qrl.actors.envs import EnvActor
from qrl.rl.envspec import EnvSpec
from qrl.runtime.config import Config
from qrl.runtime.loop import StopCheck
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore, wait_for_weights


class VectorActor(EnvActor):
    """Base of the vector-env actors. Subclasses build ``self.net`` and implement
    :meth:`advance` and :meth:`waited_s`; :func:`qrl.runtime.loop.run_role` runs them.
    ``self.env`` describes the env (read once, :class:`qrl.rl.envspec.EnvSpec`: given, or
    read from ``cfg.env``); ``self.envs`` are the copies it plays."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: Config,
        actor_id: int,
        env: EnvSpec | None = None,
    ) -> None:
        torch.set_num_threads(1)
        super().__init__(cfg, actor_id, env)
        self.client, self.keys = client, keys
        self.n_actions = self.action_size(self.env)
        self.rng = np.random.default_rng(cfg.seed * 10_000 + actor_id)
        self.weights = WeightStore(client, keys)
        self.net: torch.nn.Module
        self.version = -1
        self.units = 0  # units of work done (vector steps, unrolls)

    def wait_for_weights(self, should_stop: StopCheck, timeout: float = 600) -> bool:
        """Block until the learner published weights (:func:`qrl.wire.weights.wait_for_weights`)."""
        return wait_for_weights(self.refresh_weights, should_stop, timeout)

    def refresh_weights(self) -> bool:
        """Load newer weights if the learner published some (one HGET when not)."""
        v = self.weights.load_into(self.net, newer_than=self.version)
        if v is None:
            return False
        self.version = v
        return True

    # -- for subclasses
    def action_size(self, env: EnvSpec) -> int:
        """The number of discrete actions; a continuous-action actor returns the action
        vector's length."""
        return env.discrete_actions()

    def advance(self, obs: np.ndarray, should_stop: StopCheck) -> np.ndarray | None:
        """One unit of work from ``obs`` (a vector step, an unroll); returns the observation
        to go on from, or ``None`` if stopped while pushing."""
        raise NotImplementedError

    def finish(self, should_stop: StopCheck) -> None:
        """Push what is left before the actor ends."""

    def waited_s(self) -> float:
        """Seconds spent waiting for room in the streams it pushes to (backpressure)."""
        raise NotImplementedError

    def extra_metrics(self) -> dict[str, float]:
        return {}

    # -- the role
    def start(self, should_stop: StopCheck) -> bool:
        if not self.wait_for_weights(should_stop):
            return False
        self.obs, _ = self.envs.reset()
        return True

    def step(self, should_stop: StopCheck) -> bool:
        """One unit of work; the weights are checked every ``weight_poll`` units."""
        obs = self.advance(self.obs, should_stop)
        if obs is None:
            return False
        self.obs = obs
        self.units += 1
        if self.units % self.cfg.weight_poll == 0:
            self.refresh_weights()
        return True

    def close(self, should_stop: StopCheck) -> None:
        self.finish(should_stop)

    def metrics(self) -> dict[str, Any]:
        """Env steps, the episodes finished since the last report, the policy version."""
        return {
            **self.episodes(),
            "version": self.version,
            "backpressure_s": self.waited_s(),
            **self.extra_metrics(),
        }
