"""Replay items on their way to the Ape-X family's sharded experience streams, and the rate
limit against the learner: what an actor that feeds the replay needs besides its envs. The
actors (:class:`qrl.actors.replay.ReplaySink`) use one of each; an inference server of
R2D2 (:mod:`qrl.inference.sequences`) one feed per actor it acts for and one limit.

Follow one batch: :meth:`ReplayFeed.add` keeps the items a step completed, with their env
slot; :meth:`ReplayFeed.flush` pushes them, one message per shard (the shard of their env
slot, :func:`qrl.replay.shards.shard_of_slots`), through
:class:`qrl.wire.streams.StreamProducer`; :meth:`RateLimit.throttle` then holds the caller
while the run's env steps are ahead of what the learner's updates allow."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import redis

from qrl.algos.apex_family.config import ReplayConfig
from qrl.replay.shards import shard_of_slots
from qrl.wire import clock
from qrl.wire.codec import encode
from qrl.wire.faults import repaired, warn_every
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamProducer

# (items, their env slots) -> the kind and fields of their message, priorities included
Message = Callable[[list[Any], np.ndarray], tuple[str, dict[str, Any]]]


class ReplayFeed:
    """The replay items of actor ``actor_id``'s env slots not pushed yet, and a producer
    per replay shard (each shard's stream has its own keys: on a cluster, its own node)."""

    def __init__(
        self, client: redis.Redis, keys: RunKeys, cfg: ReplayConfig, actor_id: int, message: Message
    ) -> None:
        self.cfg, self.actor_id, self.message = cfg, actor_id, message
        self.pending: list[Any] = []
        self.pending_slots: list[int] = []  # the env slot of each
        self.producers = [
            StreamProducer(client, k.experience, maxlen=cfg.stream_maxlen, keys=k)
            for k in keys.shards(cfg.replay_shards)
        ]
        self.shard_of = shard_of_slots(actor_id, cfg.envs_per_actor, cfg.replay_shards)

    def add(self, items: list[Any], slots: list[int]) -> None:
        self.pending += items
        self.pending_slots += slots

    @property
    def ready(self) -> bool:
        """Whether a batch's worth (``actor_batch``) is pending."""
        return len(self.pending) >= self.cfg.actor_batch

    def flush(self, version: int, should_stop: Callable[[], bool]) -> bool:
        """Push the pending items, one message per shard, as acted with weights
        ``version``; False if stopped while waiting for room."""
        if not self.pending:
            return True
        pending, slots = self.pending, np.asarray(self.pending_slots)
        shard = self.shard_of[slots]
        self.pending, self.pending_slots = [], []
        for s, producer in enumerate(self.producers):
            mine = np.flatnonzero(shard == s)
            if not len(mine):
                continue
            kind, fields = self.message([pending[i] for i in mine], slots[mine])
            payload = encode(
                kind,
                {**fields, "version": version, "actor": self.actor_id, "batch": uuid.uuid4().hex},
            )
            if producer.add(payload, should_stop=should_stop) is None:
                return False
        return True

    def waited_s(self) -> float:
        return sum(p.waited_s for p in self.producers)


class RateLimit:
    """Ape-X's rate limit: the run's actors together take at most ``learning_starts +
    steps_per_update x (learner updates)`` env steps. ``share`` is how many times its own
    steps the caller believes the run's count can be (an actor: ``actors``)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, cfg: ReplayConfig, share: float) -> None:
        self.client, self.keys, self.cfg, self.share = client, keys, cfg, share
        self.counted = 0  # steps already added to the run's global env-step counter
        self.throttled_s = 0.0

    def env_steps(self, steps: int) -> int:
        """The run's env steps, our ``steps`` added (HINCRBY on its stats). Anyone with the
        run's keys can write that count: garbage (the wrong type, not a whole number, about
        to overflow) is repaired (:meth:`_reset`), and what is believed is at least our own
        steps and at most our fair share's worth, so a count lowered or raised by someone
        else neither lifts the limit for good nor holds actors for good."""
        key, add = self.keys.stats, steps - self.counted
        total = None
        incr = partial(self.client.hincrby, key, "env_steps", add)
        for _ in range(2):
            try:
                total = repaired(self.client, key, incr, None)
                if total is None or total >= 0:  # honest counts never go below 0
                    break
                why = f"{total}, below 0"
            except redis.ResponseError as e:  # not an integer, or it would overflow
                why = str(e)
            warn_every(f"{key}:env_steps", "%s env_steps was garbage (%s): reset", key, why)
            self._reset(key)
            total = None
        self.counted = steps
        return int(min(max(total or 0, steps), steps * max(self.share, 1)))

    def _reset(self, key: str) -> None:
        """Start the count again with what an actor's ACL user may do (XADD, SET, DEL,
        HINCRBY: not HDEL or HSET): a whole number is taken back to 0 by HINCRBY; anything
        else only by deleting the stats hash, its other counters (shown by ``qrl status``)
        with it. Another actor resetting at the same time may take it far below 0: the next
        count sees that and resets it again."""
        raw = self.client.hget(key, "env_steps")
        try:
            self.client.hincrby(key, "env_steps", -int(raw))  # type: ignore[arg-type]
        except (TypeError, ValueError, redis.ResponseError):  # gone, not whole, or -2^63
            self.client.delete(key)

    def throttle(
        self,
        steps: int,
        version: int,
        progress: Callable[[], int],
        should_stop: Callable[[], bool],
    ) -> bool:
        """Count our ``steps`` in the run's total and wait while the total is ahead of what
        the learner's progress allows; False if stopped first. Its progress is ``version``,
        the weights the caller loaded, and while it waits ``progress()``, which loads newer
        ones and returns their version (a blob that passed validation: a bare version field
        anyone with the run's keys can set does not count; see :mod:`qrl.wire.weights` for
        versions far ahead)."""
        total = self.env_steps(steps)
        spu = self.cfg.steps_per_update
        if spu <= 0:
            return True
        t0 = time.monotonic()
        while total > self.cfg.learning_starts + spu * max(version, 0):
            if should_stop():
                return False
            clock.sleep(0.005)
            version = progress()
            total = self.env_steps(steps)
        self.throttled_s += time.monotonic() - t0
        return True
