"""The Ape-X family's batch source (Ape-X, Ape-X DPG, R2D2, Gorila): batches sampled from the
Redis replay by sampler processes (:mod:`qrl.replay.sampler`), each ring slot given back
with the new priorities of its batch, or the lowest priority for a batch no step was taken
on (so it is not drawn again and again)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import torch

from qrl.algos.apex_family.config import ReplayConfig
from qrl.learners.fed import FedSource, tensor_on
from qrl.learners.rule import Update
from qrl.replay.sampler import Sampler, SamplerSpec
from qrl.replay.store import RecordLayout, Sample
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)


class Batch:
    """A sample of transitions as tensors on the learner's device."""

    def __init__(self, s: Sample, device: torch.device) -> None:
        b = s.batch
        self.ids = s.ids
        self.slot = s.slot
        on = tensor_on(device)
        t = lambda a: on(np.ascontiguousarray(a))  # noqa: E731
        self.obs = t(b["obs"])  # from a ring slot: a view of it on CPU, no copy
        a = b["action"]  # discrete (int) or a continuous vector (Ape-X DPG)
        self.action = t(a.astype(np.int64) if a.dtype.kind in "iu" else a.astype(np.float32))
        self.ret, self.disc = t(b["ret"]), t(b["disc"])
        self.next_obs = t(b["next_obs"])
        self.weight = t(s.weights)


class ReplaySource(FedSource):
    """Batches of the replay's items in ``layout``, made by ``batch`` (a sample and the
    device: :class:`Batch`, R2D2's sequences), drawn with ``seed`` once the replay holds
    ``start_items``."""

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        keys: RunKeys,
        cfg: ReplayConfig,
        device: torch.device,
        layout: RecordLayout,
        *,
        batch: Callable[[Sample, torch.device], Any] = Batch,
        start_items: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(device)
        self.spec = SamplerSpec(
            connect,
            keys,
            layout,
            cfg.replay_capacity,
            cfg.replay_mode,
            cfg.alpha,
            cfg.beta,
            cfg.batch_size,
            cfg.learning_starts if start_items is None else start_items,
            cfg.seed if seed is None else seed,
            cfg.replay_shards,
        )
        self.samplers, self.prefetch = cfg.samplers, cfg.prefetch
        self.make = batch
        self.replay_size = 0
        self.feed: Sampler | None = None

    # -- the sampler processes: Redis I/O away from the gradient loop's GIL
    def open(self) -> Sampler:
        return Sampler(self.spec, self.samplers, self.prefetch)

    def next(self, timeout: float, updates: int) -> Any | None:
        return self.fetch(timeout, self._batch)

    def _batch(self, s: Sample) -> Any:
        self.replay_size = s.size
        return self.make(s, self.device)

    def done(self, batch: Any, update: Update | None) -> None:
        """The batch's ring slot goes back to its sampler with the new priorities (+1e-6:
        none is 0), or the lowest (0) if no step was taken on it."""
        if update is not None and update.priorities is not None:
            priorities = update.priorities.cpu().numpy() + 1e-6
        else:
            priorities = np.zeros(len(batch.weight), np.float32)
        if self.feed is not None:
            self.feed.release(batch.slot, priorities)

    def metrics(self) -> dict[str, float]:
        return {"replay_size": float(self.replay_size)}
