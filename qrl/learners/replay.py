"""What the Ape-X family's learners share (Ape-X, Ape-X DPG, R2D2): batches sampled from the
Redis replay by a sampler process (:mod:`qrl.replay.sampler`), new priorities sent back,
a batch with a non-finite loss sent to the lowest priority, a target network synced at the
start. A subclass builds its networks (``build``: the net, ``self.target``, ``self.layout``
of the replay items) and computes ``loss`` (setting the batch's new ``priority``)."""

from __future__ import annotations

import numpy as np
import torch

from qrl.learners.base import Learner
from qrl.replay.sampler import Sampler, SamplerSpec
from qrl.replay.store import RecordLayout, Sample


class Batch:
    """A sample as tensors on the learner's device."""

    def __init__(self, s: Sample, device: torch.device) -> None:
        b = s.batch
        self.ids = s.ids
        self.obs = torch.from_numpy(np.ascontiguousarray(b["obs"])).to(device)
        a = b["action"]  # discrete (int) or a continuous vector (Ape-X DPG)
        a = a.astype(np.int64) if a.dtype.kind in "iu" else a.astype(np.float32)
        self.action = torch.from_numpy(a).to(device)
        self.ret = torch.from_numpy(b["ret"].copy()).to(device)
        self.disc = torch.from_numpy(b["disc"].copy()).to(device)
        self.next_obs = torch.from_numpy(np.ascontiguousarray(b["next_obs"])).to(device)
        self.weight = torch.from_numpy(s.weights).to(device)
        self.priority: torch.Tensor | None = None  # the loss sets it: new priorities


class ReplayLearner(Learner):
    batch_type: type = Batch  # a sample as tensors
    replay_size = 0
    _sampler: Sampler | None = None
    target: torch.nn.Module
    layout: RecordLayout

    def sample_seed(self) -> int:
        """The seed of the sampler's draws (each of several learners its own)."""
        return self.cfg.seed

    def start_items(self) -> int:
        """Replay items the sampler waits for before the first batch."""
        return self.cfg.learning_starts

    # -- the sampler process: Redis I/O away from the gradient loop's GIL
    def start_threads(self) -> None:
        """Start the sampler process (no thread)."""
        self.target.load_state_dict(self.net.state_dict())
        cfg = self.cfg
        self._sampler = Sampler(
            SamplerSpec(
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
        )

    def stop_threads(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None

    def next_batch(self, timeout: float) -> Batch | None:
        try:
            item = self._sampler.get(timeout) if self._sampler is not None else None
        except RuntimeError as e:
            self.fail(str(e))
            return None
        if item is None:
            return None
        self.replay_size = item.size
        return self.batch_type(item, self.device)

    def after_step(self, b: Batch) -> None:
        """New priorities to the replay; the target network copied every ``target_update``
        updates (Ape-X, R2D2; Ape-X DPG moves its own by Polyak averaging instead)."""
        self.send_priorities(b)
        if self.updates % self.cfg.target_update == 0:
            self.target.load_state_dict(self.net.state_dict())

    def after_skip(self, b: Batch) -> None:
        """A batch that gave a non-finite loss goes to the lowest priority, so it is not drawn
        again and again."""
        if self._sampler is not None:
            self._sampler.send_priorities(b.ids, np.zeros(len(b.ids)))

    def send_priorities(self, b: Batch) -> None:
        assert b.priority is not None and self._sampler is not None
        self._sampler.send_priorities(b.ids, b.priority.cpu().numpy() + 1e-6)

    def extra_metrics(self) -> dict[str, float]:
        return {"replay_size": float(self.replay_size)}
