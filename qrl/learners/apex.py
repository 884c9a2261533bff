"""The Ape-X learner: double DQN with a dueling head and n-step targets, trained on batches
sampled from the Redis replay, sending priorities back and publishing weights.

Sampling runs in a prefetch thread and priority updates in a writer thread, so the gradient
step does not wait on Redis; both talk to Redis through their own connections while torch
releases the GIL.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import numpy as np
import redis
import torch
import torch.nn.functional as F

from qrl.envs import env_spec
from qrl.learners.base import Learner
from qrl.models import QNetwork
from qrl.replay.role import make_replay
from qrl.replay.store import Sample

log = logging.getLogger(__name__)


class Batch:
    """A sample as tensors on the learner's device."""

    def __init__(self, s: Sample, device: torch.device) -> None:
        b = s.batch
        self.ids = s.ids
        self.obs = torch.from_numpy(np.ascontiguousarray(b["obs"])).to(device)
        self.action = torch.from_numpy(b["action"].astype(np.int64)).to(device)
        self.ret = torch.from_numpy(b["ret"].copy()).to(device)
        self.disc = torch.from_numpy(b["disc"].copy()).to(device)
        self.next_obs = torch.from_numpy(np.ascontiguousarray(b["next_obs"])).to(device)
        self.weight = torch.from_numpy(s.weights).to(device)
        self.td: torch.Tensor | None = None


class ApexLearner(Learner):
    algo = "apex"

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        cfg = self.cfg
        obs_shape, _, n_actions = env_spec(cfg.env)
        net = QNetwork(obs_shape, n_actions, cfg.hidden, cfg.dueling).to(self.device)
        self.target = QNetwork(obs_shape, n_actions, cfg.hidden, cfg.dueling).to(self.device)
        # sampling and priority writing happen on their own connections and threads
        self.sampler = make_replay(self.client_factory(), self.keys, cfg, seed=cfg.seed)
        self.writer = make_replay(self.client_factory(), self.keys, cfg)
        self.priorities: queue.Queue[tuple[list[bytes], np.ndarray] | None] = queue.Queue(16)
        self._threads: list[threading.Thread] = []
        return net, torch.optim.Adam(net.parameters(), lr=cfg.lr, eps=cfg.adam_eps)

    # -- the two Redis threads
    def _prefetch(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.sampler.size() < self.cfg.learning_starts:
                    time.sleep(0.05)
                    continue
                s = self.sampler.sample(self.cfg.batch_size, self.cfg.beta)
                if s is None:
                    continue
                self.offer(Batch(s, self.device))
        except Exception:
            self.fail("prefetch thread")

    def _write_priorities(self) -> None:
        """Send priority updates, merging whatever queued up into one ZADD XX."""
        done = False
        while not done:
            items = [self.priorities.get()]
            while True:
                try:
                    items.append(self.priorities.get_nowait())
                except queue.Empty:
                    break
            done = items[-1] is None
            batches = [i for i in items if i is not None]
            if not batches:
                continue
            ids = [m for b_ids, _ in batches for m in b_ids]
            prios = np.concatenate([p for _, p in batches])
            try:
                self.writer.update_priorities(ids, prios)
            except redis.RedisError:
                log.exception("priority update failed")

    def start_threads(self) -> None:
        self.target.load_state_dict(self.net.state_dict())
        self._threads = [
            threading.Thread(target=self._prefetch, name="prefetch", daemon=True),
            threading.Thread(target=self._write_priorities, name="priorities", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop_threads(self) -> None:
        with contextlib.suppress(queue.Full):
            self.priorities.put(None, timeout=5)
        for t in self._threads:
            t.join(timeout=5)

    # -- learning
    def next_batch(self, timeout: float) -> Batch | None:
        return self.take(timeout)

    def loss(self, b: Batch) -> torch.Tensor:
        """IS-weighted Huber loss of the n-step double-DQN target."""
        q = self.net(b.obs).gather(1, b.action[:, None])[:, 0]
        with torch.no_grad():
            best = self.net(b.next_obs).argmax(dim=1, keepdim=True)
            target = b.ret + b.disc * self.target(b.next_obs).gather(1, best)[:, 0]
        b.td = (target - q).detach()
        return (b.weight * F.smooth_l1_loss(q, target, reduction="none")).mean()

    def after_step(self, b: Batch) -> None:
        assert b.td is not None
        try:  # the writer merges what queues up; if it is stuck, drop rather than block
            self.priorities.put((b.ids, b.td.abs().cpu().numpy() + 1e-6), timeout=5)
        except queue.Full:
            log.warning("priority writer is behind: dropped one batch of priority updates")
        if self.updates % self.cfg.target_update == 0:
            self.target.load_state_dict(self.net.state_dict())

    def metrics(self) -> dict[str, float]:
        return {"replay_size": float(self.sampler.last_size)}
