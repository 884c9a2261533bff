"""The PPO actor's sink and weights client: rollouts with the behaviour logits and values to
the rollout stream (:func:`rollout_sink`, a :class:`qrl.actors.unrolls.UnrollSink`);
``qrl/learners/ppo.py`` consumes them. Its policy is the unroll algorithms'
(:class:`qrl.actors.unrolls.SampledPolicy`).

Paced by the published version (``pace_actors``): each new version gives an actor its share
of one batch (``batch_unrolls / (actors * envs_per_actor)`` entries) to send, and it holds at
most ``1 + batches_ahead`` shares (it starts full). The actors together then make one batch
per update: with ``batches_ahead`` 1 they act on the next batch while the learners train on
this one, so rollouts are one update old when trained on and the two sides overlap; with 0
they take turns. Either way no rollout is made only to be dropped as stale, and the actors
cannot race ahead of learners that share their CPU. The pacing counts versions as they are
loaded, so it lives in the weights client (:class:`PacedWeights`)."""

from __future__ import annotations

from typing import Any

import redis
import torch

from qrl.actors.unrolls import UnrollSink
from qrl.actors.weights import Weights
from qrl.algos.ppo.config import PPOConfig
from qrl.algos.ppo.keys import rollouts
from qrl.algos.ppo.messages import rollout_schema
from qrl.rl.envspec import EnvSpec
from qrl.runtime.loop import StopCheck
from qrl.wire import clock
from qrl.wire.keys import RunKeys


def rollout_sink(
    client: redis.Redis, keys: RunKeys, cfg: PPOConfig, actor_id: int, env: EnvSpec
) -> UnrollSink:
    return UnrollSink(client, keys, rollouts(keys), cfg, actor_id, env, rollout_schema)


class PacedWeights(Weights):
    """The weights client of a PPO actor: a share of credit per version loaded; with
    ``pace_actors``, a unit waits for credit (:meth:`ready`). It looks in line: the credit
    of a version counts from the unit it is loaded at."""

    ahead = False

    def __init__(
        self, client: redis.Redis, keys: RunKeys, net: torch.nn.Module, cfg: PPOConfig
    ) -> None:
        super().__init__(client, keys, net, cfg.weight_poll)
        self.paced = cfg.pace_actors
        self.share = -(-cfg.batch_unrolls // (cfg.actors * cfg.envs_per_actor))
        self.most = self.share * (1 + cfg.batches_ahead)
        self.credit = self.most  # entries it may send before a new version comes
        self.paced_s = 0.0
        self.version_at, self.interval = clock.now(), 1.0  # seconds between versions
        self.unpaced = 0  # entries sent without credit because no new version came

    def refresh(self) -> bool:
        before = self.version
        if not super().refresh():
            return False
        if before >= 0:  # a share per version published since (the first weights: none)
            self.credit = min(self.most, self.credit + self.share * (self.version - before))
        now = clock.now()
        self.interval = 0.8 * self.interval + 0.2 * (now - self.version_at)
        self.version_at = now
        return True

    def ready(self, should_stop: StopCheck) -> bool:
        """Wait until this actor may send another entry; False if stopped. If no new version
        comes in three times the usual interval (fewer actors than ``actors`` run, or
        rollouts were lost), it sends one more so the learners can go on."""
        if not self.paced:
            return True
        start = clock.now()
        deadline = start + max(1.0, 3 * self.interval)
        try:
            while self.credit < 1:
                if should_stop():
                    return False
                if clock.now() > deadline:
                    self.unpaced += 1
                    return True
                if not self.refresh():
                    clock.sleep(0.002)
            return True
        finally:
            self.paced_s += clock.now() - start

    def done(self) -> None:
        self.credit = max(0, self.credit - 1)  # before the look for weights: it may add some
        super().done()

    def metrics(self) -> dict[str, Any]:
        return {**super().metrics(), "paced_s": self.paced_s, "unpaced": float(self.unpaced)}
