"""The Ape-X learner: double DQN with a dueling head and n-step targets, trained on batches
sampled from the Redis replay, sending priorities back and publishing weights.

Sampling runs in a prefetch thread and priority updates in a writer thread, so the gradient
step (``ApexLearner.update``) does not wait on Redis; both talk to Redis through their own
connections while torch releases the GIL.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis
import torch
import torch.nn.functional as F

from qrl.checkpoint import load_checkpoint, save_checkpoint
from qrl.configs import ApexConfig
from qrl.envs import env_spec
from qrl.keys import RunKeys
from qrl.metrics import report
from qrl.models import QNetwork
from qrl.replay.role import make_replay
from qrl.replay.store import Sample
from qrl.weights import WeightStore

log = logging.getLogger(__name__)


def pick_device(device: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(device)


class Batch:
    """A sample as tensors on the learner's device."""

    def __init__(self, s: Sample, device: torch.device) -> None:
        b = s.batch
        self.ids = s.ids
        self.obs = torch.from_numpy(np.ascontiguousarray(b["obs"])).to(device, non_blocking=True)
        self.action = torch.from_numpy(b["action"].astype(np.int64)).to(device)
        self.ret = torch.from_numpy(b["ret"].copy()).to(device)
        self.disc = torch.from_numpy(b["disc"].copy()).to(device)
        self.next_obs = torch.from_numpy(np.ascontiguousarray(b["next_obs"])).to(device)
        self.weight = torch.from_numpy(s.weights).to(device)


class ApexLearner:
    def __init__(
        self,
        client_factory: Callable[[], redis.Redis],
        keys: RunKeys,
        cfg: ApexConfig,
        device: str = "auto",
        checkpoint: Path | None = None,
        threads: int = 1,
    ) -> None:
        self.keys, self.cfg = keys, cfg
        self.client = client_factory()
        self.device = pick_device(device)
        torch.set_num_threads(threads)  # actors share the cores: one compute thread by default
        torch.manual_seed(cfg.seed)
        obs_shape, _, n_actions = env_spec(cfg.env)
        self.net = QNetwork(obs_shape, n_actions, cfg.hidden, cfg.dueling).to(self.device)
        self.target = QNetwork(obs_shape, n_actions, cfg.hidden, cfg.dueling).to(self.device)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=cfg.lr, eps=cfg.adam_eps)
        self.updates = 0
        self.checkpoint = checkpoint
        if checkpoint is not None and checkpoint.exists():
            state = load_checkpoint(checkpoint, "apex", cfg)
            self.net.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.updates = int(state["step"])
            log.info("resumed from %s at update %d", checkpoint, self.updates)
        self.target.load_state_dict(self.net.state_dict())
        self.weights = WeightStore(self.client, keys)
        # sampling and priority writing happen on their own connections and threads
        self.sampler = make_replay(client_factory(), keys, cfg, seed=cfg.seed)
        self.writer = make_replay(client_factory(), keys, cfg)
        self.batches: queue.Queue[Batch] = queue.Queue(maxsize=4)
        self.priorities: queue.Queue[tuple[list[bytes], np.ndarray] | None] = queue.Queue(
            maxsize=16
        )
        self.stopping = threading.Event()
        self.skipped = 0  # updates skipped for a non-finite loss
        self.sample_wait = 0.0

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
                batch = Batch(s, self.device)
                while not self.stopping.is_set():
                    try:
                        self.batches.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except Exception:
            log.exception("prefetch thread failed")
            self.stopping.set()

    def _write_priorities(self) -> None:
        while True:
            item = self.priorities.get()
            if item is None:
                return
            try:
                self.writer.update_priorities(*item)
            except redis.RedisError:
                log.exception("priority update failed")

    # -- learning
    def update(self, b: Batch) -> float:
        """One gradient step on batch ``b``; returns the loss (NaN if skipped)."""
        q = self.net(b.obs).gather(1, b.action[:, None])[:, 0]
        with torch.no_grad():
            best = self.net(b.next_obs).argmax(dim=1, keepdim=True)
            target = b.ret + b.disc * self.target(b.next_obs).gather(1, best)[:, 0]
        td = target - q
        loss = (b.weight * F.smooth_l1_loss(q, target, reduction="none")).mean()
        if not torch.isfinite(loss):
            self.skipped += 1
            log.warning(
                "non-finite loss at update %d: skipped, weights not published", self.updates
            )
            return float("nan")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.updates += 1
        self.priorities.put((b.ids, td.detach().abs().cpu().numpy() + 1e-6))
        if self.updates % self.cfg.target_update == 0:
            self.target.load_state_dict(self.net.state_dict())
        if self.updates % self.cfg.publish_every == 0:
            self.publish()
        return loss.item()

    def publish(self) -> None:
        self.weights.publish(self.net, version=self.updates)

    def save(self) -> None:
        if self.checkpoint is not None:
            save_checkpoint(self.checkpoint, "apex", self.cfg, self.net, self.opt, self.updates)

    def run(
        self,
        should_stop: Callable[[], bool],
        max_updates: int | None = None,
        report_every: float = 1.0,
        checkpoint_every: float = 60.0,
    ) -> int:
        """Train until ``should_stop()``; returns the number of updates done."""
        if self.weights.version() < self.updates or self.weights.version() < 0:
            self.publish()  # actors start from the learner's initial (or resumed) weights
        threads = [
            threading.Thread(target=self._prefetch, name="prefetch", daemon=True),
            threading.Thread(target=self._write_priorities, name="priorities", daemon=True),
        ]
        for t in threads:
            t.start()
        now = time.monotonic()
        next_report, next_ckpt, last, last_t = now + report_every, now + checkpoint_every, 0, now
        losses: list[float] = []
        start_updates = self.updates
        try:
            while not should_stop() and not self.stopping.is_set():
                if max_updates is not None and self.updates - start_updates >= max_updates:
                    break
                t0 = time.monotonic()
                try:
                    b = self.batches.get(timeout=0.2)
                except queue.Empty:
                    b = None
                self.sample_wait += time.monotonic() - t0
                if b is not None:
                    losses.append(self.update(b))
                now = time.monotonic()
                if now >= next_report:
                    report(
                        self.client,
                        self.keys,
                        "learner",
                        0,
                        updates=self.updates,
                        updates_per_s=(self.updates - last) / (now - last_t),
                        loss=float(np.nanmean(losses)) if losses else 0.0,
                        replay_size=self.sampler._n,
                        sample_wait_s=self.sample_wait,
                        skipped=self.skipped,
                    )
                    losses, last, last_t, next_report = [], self.updates, now, now + report_every
                if now >= next_ckpt:
                    self.save()
                    next_ckpt = now + checkpoint_every
        finally:
            self.stopping.set()
            self.priorities.put(None)
            for t in threads:
                t.join(timeout=5)
            if self.weights.version() < self.updates:
                self.publish()
            self.save()
        return self.updates - start_updates
