"""The PPO actor: rollouts with the behaviour logits and values to the rollout stream
(:class:`qrl.actors.unrolls.UnrollActor`); ``qrl/learners/ppo.py`` consumes them.

Paced by the published version (``pace_actors``): each new version gives an actor its share
of one batch (``batch_unrolls / (actors * envs_per_actor)`` entries) to send, and it holds at
most ``1 + batches_ahead`` shares (it starts full). The actors together then make one batch
per update: with ``batches_ahead`` 1 they act on the next batch while the learners train on
this one, so rollouts are one update old when trained on and the two sides overlap; with 0
they take turns. Either way no rollout is made only to be dropped as stale, and the actors
cannot race ahead of learners that share their CPU."""

from __future__ import annotations

import numpy as np
import redis

from qrl.actors.unrolls import UnrollActor
from qrl.algos.ppo.config import PPOConfig
from qrl.algos.ppo.keys import rollouts
from qrl.algos.ppo.messages import rollout_schema
from qrl.rl.envspec import EnvSpec
from qrl.runtime.loop import StopCheck
from qrl.wire import clock
from qrl.wire.keys import RunKeys


class PPOActor(UnrollActor):
    schema = staticmethod(rollout_schema)
    stream = staticmethod(rollouts)

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: PPOConfig,
        actor_id: int = 0,
        env: EnvSpec | None = None,
    ) -> None:
        super().__init__(client, keys, cfg, actor_id, env)
        self.share = -(-cfg.batch_unrolls // (cfg.actors * cfg.envs_per_actor))
        self.most = self.share * (1 + cfg.batches_ahead)
        self.credit = self.most  # entries it may send before a new version comes
        self.paced_s = 0.0
        self.version_at, self.interval = clock.now(), 1.0  # seconds between versions
        self.unpaced = 0  # entries sent without credit because no new version came

    def refresh_weights(self) -> bool:
        before = self.version
        if not super().refresh_weights():
            return False
        if before >= 0:  # a share per version published since (the first weights: none)
            self.credit = min(self.most, self.credit + self.share * (self.version - before))
        now = clock.now()
        self.interval = 0.8 * self.interval + 0.2 * (now - self.version_at)
        self.version_at = now
        return True

    def _wait_for_credit(self, should_stop: StopCheck) -> bool:
        """Wait until this actor may send another entry; False if stopped. If no new version
        comes in three times the usual interval (fewer actors than ``actors`` run, or
        rollouts were lost), it sends one more so the learners can go on."""
        start = clock.now()
        deadline = start + max(1.0, 3 * self.interval)
        try:
            while self.credit < 1:
                if should_stop():
                    return False
                if clock.now() > deadline:
                    self.unpaced += 1
                    return True
                if not self.refresh_weights():
                    clock.sleep(0.002)
            return True
        finally:
            self.paced_s += clock.now() - start

    def advance(self, obs: np.ndarray, should_stop: StopCheck) -> np.ndarray | None:
        if self.cfg.pace_actors and not self._wait_for_credit(should_stop):
            return None
        out = super().advance(obs, should_stop)
        self.credit = max(0, self.credit - 1)
        return out

    def extra_metrics(self) -> dict[str, float]:
        return {"paced_s": self.paced_s, "unpaced": float(self.unpaced)}
