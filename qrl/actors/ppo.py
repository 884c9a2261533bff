"""The PPO actor: rollouts with the behaviour logits and values to the rollout stream
(:class:`qrl.actors.unrolls.UnrollActor`); ``qrl/learners/ppo.py`` consumes them.

Paced by the published version (``pace_actors``): an actor sends at most its share of one
batch (``batch_unrolls / (actors * envs_per_actor)`` entries) with each version, then waits
for the next. The actors together then make one batch per update, so the learners train on
rollouts of the weights they last published, none is made only to be dropped as stale, and
while the learners train the actors leave them the CPU (on a small machine they share it)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import redis

from qrl.actors.unrolls import UnrollActor
from qrl.algos.ppo.keys import rollouts
from qrl.algos.ppo.messages import KIND
from qrl.rl.envspec import EnvSpec
from qrl.runtime.loop import StopCheck
from qrl.wire.keys import RunKeys


class PPOActor(UnrollActor):
    kind = KIND
    values = True
    stream = staticmethod(rollouts)

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: Any,
        actor_id: int = 0,
        env: EnvSpec | None = None,
    ) -> None:
        super().__init__(client, keys, cfg, actor_id, env)
        per_version = -(-cfg.batch_unrolls // (cfg.actors * cfg.envs_per_actor))
        self.quota = per_version if cfg.pace_actors else 0
        self.sent_version, self.sent = -1, 0  # entries sent with that version
        self.paced_s = 0.0
        self.version_at, self.interval = time.monotonic(), 1.0  # seconds between versions
        self.unpaced = 0  # entries sent past the quota because no new version came

    def refresh_weights(self) -> bool:
        if not super().refresh_weights():
            return False
        now = time.monotonic()
        self.interval = 0.8 * self.interval + 0.2 * (now - self.version_at)
        self.version_at = now
        return True

    def _wait_for_version(self, should_stop: StopCheck) -> bool:
        """Wait until this actor may send with the current weights; False if stopped. If no
        new version comes in three times the usual interval (fewer actors than ``actors``
        run, or rollouts were dropped), it sends one more entry so the learners can go on."""
        start = time.monotonic()
        deadline = start + max(1.0, 3 * self.interval)
        try:
            while self.sent_version == self.version and self.sent >= self.quota:
                if should_stop():
                    return False
                if time.monotonic() > deadline:
                    self.unpaced += 1
                    return True
                if not self.refresh_weights():
                    time.sleep(0.002)
            return True
        finally:
            self.paced_s += time.monotonic() - start

    def advance(self, obs: np.ndarray, should_stop: StopCheck) -> np.ndarray | None:
        if self.quota and not self._wait_for_version(should_stop):
            return None
        version = self.version
        out = super().advance(obs, should_stop)
        if version != self.sent_version:
            self.sent_version, self.sent = version, 0
        self.sent += 1
        return out

    def extra_metrics(self) -> dict[str, float]:
        return {"paced_s": self.paced_s, "unpaced": float(self.unpaced)}
