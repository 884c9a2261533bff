"""What the Ape-X family's learners share (Ape-X, Ape-X DPG, R2D2): batches sampled from the
Redis replay by a sampler process (:mod:`qrl.replay.sampler`), new priorities sent back,
a batch with a non-finite loss sent to the lowest priority, a target network synced at the
start. A subclass builds its networks (``build``: the net, ``self.target``, ``self.layout``
of the replay items) and computes ``loss`` (setting the batch's new ``priority``)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from qrl.learners.fed import FedLearner, tensor_on
from qrl.replay.sampler import Sampler, SamplerSpec
from qrl.replay.store import RecordLayout, Sample

log = logging.getLogger(__name__)


class Batch:
    """A sample as tensors on the learner's device."""

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
        self.priority: torch.Tensor | None = None  # the loss sets it: new priorities
        self.new_priorities: np.ndarray | None = None  # what goes back to the replay


class ReplayLearner(FedLearner):
    batch_type: type = Batch  # a sample as tensors
    replay_size = 0
    feed: Sampler | None = None
    target: torch.nn.Module
    layout: RecordLayout

    def sample_seed(self) -> int:
        """The seed of the sampler's draws (each of several learners its own)."""
        return self.cfg.seed

    def start_items(self) -> int:
        """Replay items the sampler waits for before the first batch."""
        return self.cfg.learning_starts

    # -- the sampler processes: Redis I/O away from the gradient loop's GIL
    def sampler_spec(self) -> SamplerSpec:
        cfg = self.cfg
        return SamplerSpec(
            self.client_factory,
            self.keys,
            self.layout,
            cfg.replay_capacity,
            cfg.replay_mode,
            cfg.alpha,
            cfg.beta,
            cfg.batch_size,
            self.start_items(),
            self.sample_seed(),
            cfg.replay_shards,
        )

    def start_feed(self) -> Sampler:
        self.target.load_state_dict(self.net.state_dict())
        return Sampler(self.sampler_spec(), self.cfg.samplers, self.cfg.prefetch)

    def next_batch(self, timeout: float) -> Batch | None:
        return self.fetch(timeout, self._batch)

    def _batch(self, s: Sample) -> Batch:
        self.replay_size = s.size
        return self.batch_type(s, self.device)

    def train(self, batch: Any) -> float:
        """One update; then the batch's ring slot goes back to its sampler, with the new
        priorities the update kept (:meth:`keep_priorities`, :meth:`after_skip`)."""
        batch.new_priorities = None
        try:
            return super().train(batch)
        finally:
            if self.feed is not None:
                self.feed.release(batch.slot, batch.new_priorities)

    def after_step(self, b: Batch) -> None:
        """New priorities; the target network copied every ``target_update`` updates (Ape-X,
        R2D2; Ape-X DPG moves its own by Polyak averaging instead)."""
        self.keep_priorities(b)
        if self.updates % self.cfg.target_update == 0:
            self.target.load_state_dict(self.net.state_dict())

    def after_skip(self, b: Batch) -> None:
        """A batch that gave a non-finite loss goes to the lowest priority, so it is not drawn
        again and again."""
        b.new_priorities = np.zeros(len(b.weight), np.float32)

    def keep_priorities(self, b: Batch) -> None:
        """The priorities the loss set (+1e-6: none is 0), for the replay."""
        assert b.priority is not None
        b.new_priorities = b.priority.cpu().numpy() + 1e-6

    def extra_metrics(self) -> dict[str, float]:
        return {"replay_size": float(self.replay_size)}
