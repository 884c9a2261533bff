"""The IMPALA learner: batches of unrolls from the trajectory stream (consumer group),
V-trace targets, policy-gradient + baseline + entropy loss; entries are acknowledged only
after the update that used them.

A loader thread reads and decodes entries and stacks them into batches while the main
thread computes gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import unroll_schema
from qrl.algos.impala.vtrace import vtrace
from qrl.learners.base import Learner, adam
from qrl.rl.models import PolicyValueNet
from qrl.wire.streams import Entry, StreamConsumer

log = logging.getLogger(__name__)


@dataclass
class UnrollBatch:
    entries: list[Entry]
    versions: np.ndarray  # behaviour policy version per unroll
    obs: torch.Tensor  # [T+1, B, ...]
    action: torch.Tensor  # [T, B]
    reward: torch.Tensor
    done: torch.Tensor
    logits: torch.Tensor  # [T, B, A]
    trunc_obs: torch.Tensor  # [K, ...] final observations of episodes cut by a time limit
    trunc_idx: torch.Tensor  # [K, 2] their steps (t, b): not terminated there


def stack_unrolls(entries: list[Entry], device: torch.device) -> UnrollBatch:
    """Concatenate the entries' unrolls along the batch axis."""

    def cat(name: str, axis: int = 1) -> np.ndarray:
        return np.concatenate([e.data[name] for e in entries], axis=axis)

    offsets = np.cumsum([0] + [e.data["obs"].shape[1] for e in entries[:-1]])
    idx = np.concatenate(
        [
            e.data["trunc_idx"] + np.array([0, off], np.int32)
            for e, off in zip(entries, offsets, strict=True)
        ]
    )
    # termination wins: gymnasium's TimeLimit also says truncated on the limit's step when
    # the episode terminated there, and a terminal step does not bootstrap
    terminated = cat("terminated")
    cut = ~terminated[idx[:, 0], idx[:, 1]]
    versions = np.concatenate([np.full(e.data["obs"].shape[1], e.data["version"]) for e in entries])
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return UnrollBatch(
        entries=entries,
        versions=versions,
        obs=t(cat("obs")),
        action=t(cat("action").astype(np.int64)),
        reward=t(cat("reward")),
        done=t(terminated | cat("truncated")),
        logits=t(cat("logits")),
        trunc_obs=t(cat("trunc_obs", axis=0)[cut]),
        trunc_idx=t(idx[cut].astype(np.int64)),
    )


class ImpalaLearner(Learner):
    algo = "impala"

    def build(self) -> torch.nn.Module:
        cfg = self.cfg
        self.obs_shape, obs_dtype = self.env.obs_shape, self.env.obs_dtype
        n_actions = self.env.discrete_actions()
        net = PolicyValueNet(self.obs_shape, n_actions, cfg.hidden).to(self.device)
        per_entry = cfg.envs_per_actor
        self.consumer = StreamConsumer(
            self.client_factory(),
            self.keys,
            trajectories(self.keys),
            unroll_schema(self.obs_shape, obs_dtype, n_actions, cfg.unroll, cfg.envs_per_actor),
            count=max(1, cfg.batch_unrolls // per_entry),
            block_ms=100,
            claim_idle_ms=cfg.claim_idle_ms,
        )
        self.batches: queue.Queue[UnrollBatch] = queue.Queue(maxsize=2)  # stacked, ready
        self.done: queue.SimpleQueue[list[Entry]] = queue.SimpleQueue()  # used: to acknowledge
        self._thread: threading.Thread | None = None
        self.dropped = 0  # unrolls dropped for exceeding max_policy_lag
        self.lag: list[float] = []
        self._again: UnrollBatch | None = None  # the batch to take another pass over
        self._passes_left = 0
        self.reused = 0  # extra passes taken
        return net

    def optimizer(self) -> torch.optim.Optimizer:
        cfg, params = self.cfg, self.net.parameters()
        if cfg.optimizer == "adam":
            return adam(params, lr=cfg.lr)
        return torch.optim.RMSprop(params, lr=cfg.lr, eps=0.01, alpha=0.99)

    def _ack_done(self) -> None:
        """Acknowledge the entries of every batch the gradient loop has finished with."""
        used: list[Entry] = []
        while True:
            try:
                used += self.done.get_nowait()
            except queue.Empty:
                break
        self.consumer.ack(used)

    def _load(self) -> None:
        pending: list[Entry] = []
        try:
            while not self.stopping.is_set():
                self._ack_done()
                pending += self.consumer.read()
                if sum(e.data["obs"].shape[1] for e in pending) < self.cfg.batch_unrolls:
                    continue
                batch = stack_unrolls(pending, self.device)
                while not self.stopping.is_set():  # wait for room, unless stopping
                    with contextlib.suppress(queue.Full):
                        self.batches.put(batch, timeout=0.1)
                        break
                pending = []
        except Exception:
            self.fail("loader thread")

    def start_threads(self) -> None:
        self._thread = threading.Thread(target=self._load, name="loader", daemon=True)
        self._thread.start()

    def stop_threads(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ack_done()
        self.consumer.close()

    def next_batch(self, timeout: float) -> UnrollBatch | None:
        if self._passes_left and self.batches.empty():  # the learner would wait: reuse
            self._passes_left -= 1  # the last batch (acknowledged after its first pass;
            self.reused += 1  # V-trace corrects for the updates since it was acted)
            return dataclasses.replace(self._again, entries=[])
        try:
            b = self.batches.get(timeout=timeout)
        except queue.Empty:
            return None
        lag = self.updates - b.versions
        self.lag.extend(lag.tolist())
        limit = self.cfg.max_policy_lag
        if limit and (lag > limit).any():
            keep = torch.from_numpy(lag <= limit).to(self.device)
            self.dropped += int((~keep).sum())
            if not keep.any():
                self.done.put(b.entries)
                return None
            b = self._select(b, keep)
        self._again, self._passes_left = b, self.cfg.passes - 1
        return b

    @staticmethod
    def _select(b: UnrollBatch, keep: torch.Tensor) -> UnrollBatch:
        """Only the unrolls (batch columns) in ``keep``."""
        cols = torch.nonzero(keep)[:, 0]
        new_col = torch.full((len(keep),), -1, dtype=torch.long, device=keep.device)
        new_col[cols] = torch.arange(len(cols), device=keep.device)
        tmask = keep[b.trunc_idx[:, 1]] if len(b.trunc_idx) else keep[:0]
        idx = b.trunc_idx[tmask].clone()
        if len(idx):
            idx[:, 1] = new_col[idx[:, 1]]
        return UnrollBatch(
            b.entries,
            b.versions[keep.cpu().numpy()],
            b.obs[:, cols],
            b.action[:, cols],
            b.reward[:, cols],
            b.done[:, cols],
            b.logits[:, cols],
            b.trunc_obs[tmask],
            idx,
        )

    def rewards(self, b: UnrollBatch) -> torch.Tensor:
        """The rewards V-trace gets: scaled, plus ``gamma V(final observation)`` where a
        time limit cut the episode (it would have gone on)."""
        reward = b.reward * self.cfg.reward_scale
        if len(b.trunc_idx):
            with torch.no_grad():
                _, v_final = self.net(b.trunc_obs)
            reward[b.trunc_idx[:, 0], b.trunc_idx[:, 1]] += self.cfg.gamma * v_final
        return reward

    def loss(self, b: UnrollBatch) -> torch.Tensor:
        cfg = self.cfg
        t1, bsz = b.obs.shape[:2]
        logits, values = self.net(b.obs.reshape(t1 * bsz, *self.obs_shape))
        logits = logits.reshape(t1, bsz, -1)[:-1]
        values = values.reshape(t1, bsz)
        reward = self.rewards(b)
        discounts = cfg.gamma * (~b.done).float()
        logp = F.log_softmax(logits, dim=-1)
        target_logp = logp.gather(2, b.action[..., None])[..., 0]
        behaviour_logp = F.log_softmax(b.logits, dim=-1).gather(2, b.action[..., None])[..., 0]
        vs, pg_adv = vtrace(
            behaviour_logp,
            target_logp.detach(),
            reward,
            discounts,
            values[:-1].detach(),
            values[-1].detach(),
            cfg.rho_bar,
            cfg.c_bar,
        )
        pg_loss = -(target_logp * pg_adv).mean()
        baseline_loss = 0.5 * ((vs - values[:-1]) ** 2).mean()
        entropy = -(logp.exp() * logp).sum(-1).mean()
        return pg_loss + cfg.baseline_cost * baseline_loss - cfg.entropy_cost * entropy

    def after_step(self, b: UnrollBatch) -> None:
        self.done.put(b.entries)  # the loader thread acknowledges them, off the gradient path

    def after_skip(self, b: UnrollBatch) -> None:
        # consumed all the same: the same unrolls would give the same loss again, forever
        self._again, self._passes_left = None, 0
        self.done.put(b.entries)

    def extra_metrics(self) -> dict[str, float]:
        lag, self.lag = self.lag, []
        return {
            "policy_lag": float(np.mean(lag)) if lag else 0.0,
            "policy_lag_max": float(np.max(lag)) if lag else 0.0,
            "dropped": float(self.dropped),
            "reused": float(self.reused),
        }
