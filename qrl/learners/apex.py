"""The Ape-X learner: double DQN with a dueling head and n-step targets, trained on batches
sampled from the Redis replay by a sampler process (:mod:`qrl.replay.sampler`), sending
priorities back and publishing weights."""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from qrl.envs import env_spec
from qrl.learners.base import Learner
from qrl.models import QNetwork
from qrl.replay.frames import layout_for
from qrl.replay.sampler import Sampler, SamplerSpec
from qrl.replay.store import Sample

log = logging.getLogger(__name__)


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
        self.td: torch.Tensor | None = None


class ApexLearner(Learner):
    algo = "apex"

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        cfg = self.cfg
        obs_shape, obs_dtype, n_actions = env_spec(cfg.env)
        net = QNetwork(obs_shape, n_actions, cfg.hidden, cfg.dueling).to(self.device)
        self.target = QNetwork(obs_shape, n_actions, cfg.hidden, cfg.dueling).to(self.device)
        self.replay_size = 0
        self.layout = layout_for(obs_shape, obs_dtype, n_actions)
        self._sampler: Sampler | None = None
        return net, torch.optim.Adam(net.parameters(), lr=cfg.lr, eps=cfg.adam_eps)

    # -- the sampler process: Redis I/O away from the gradient loop's GIL
    def start_threads(self) -> None:
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
                cfg.learning_starts,
                cfg.seed,
                cfg.replay_shards,
            )
        )

    def stop_threads(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None

    # -- learning
    def next_batch(self, timeout: float) -> Batch | None:
        try:
            item = self._sampler.get(timeout) if self._sampler is not None else None
        except RuntimeError as e:
            self.fail(str(e))
            return None
        if item is None:
            return None
        self.replay_size = item.size
        return Batch(item, self.device)

    def loss(self, b: Batch) -> torch.Tensor:
        """IS-weighted Huber loss of the n-step double-DQN target."""
        q = self.net(b.obs).gather(1, b.action[:, None])[:, 0]
        with torch.no_grad():
            best = self.net(b.next_obs).argmax(dim=1, keepdim=True)
            target = b.ret + b.disc * self.target(b.next_obs).gather(1, best)[:, 0]
        b.td = (target - q).detach()
        return (b.weight * F.smooth_l1_loss(q, target, reduction="none")).mean()

    def after_step(self, b: Batch) -> None:
        self.send_priorities(b)
        if self.updates % self.cfg.target_update == 0:
            self.target.load_state_dict(self.net.state_dict())

    def after_skip(self, b: Batch) -> None:
        """A batch that gave a non-finite loss goes to the lowest priority, so it is not drawn
        again and again."""
        if self._sampler is not None:
            self._sampler.send_priorities(b.ids, np.zeros(len(b.ids)))

    def send_priorities(self, b: Batch) -> None:
        assert b.td is not None and self._sampler is not None
        self._sampler.send_priorities(b.ids, b.td.abs().cpu().numpy() + 1e-6)

    def extra_metrics(self) -> dict[str, float]:
        return {"replay_size": float(self.replay_size)}
