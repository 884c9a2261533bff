"""What the unroll learners (IMPALA, PPO) share: the batch of unrolls, stacking stream entries
into one, and the loader thread that reads, decodes and stacks entries while the gradient loop
runs. Entries are acknowledged only after the update that used them (:meth:`UnrollLoader.used`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from qrl.wire.streams import Entry, StreamConsumer


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
    value: torch.Tensor | None = None  # [T, B] behaviour value estimates (PPO)

    @property
    def size(self) -> int:
        """Unrolls (batch columns)."""
        return int(self.obs.shape[1])

    def rewards(self, net: torch.nn.Module, scale: float, gamma: float) -> torch.Tensor:
        """The rewards to learn from: scaled, plus ``gamma V(final observation)`` where a time
        limit cut the episode (it would have gone on); ``net`` gives (logits, values)."""
        reward = self.reward * scale
        if len(self.trunc_idx):
            with torch.no_grad():
                _, v_final = net(self.trunc_obs)
            reward[self.trunc_idx[:, 0], self.trunc_idx[:, 1]] += gamma * v_final
        return reward

    def select(self, keep: torch.Tensor) -> UnrollBatch:
        """Only the unrolls (batch columns) in ``keep`` (a boolean mask)."""
        cols = torch.nonzero(keep)[:, 0]
        new_col = torch.full((len(keep),), -1, dtype=torch.long, device=keep.device)
        new_col[cols] = torch.arange(len(cols), device=keep.device)
        tmask = keep[self.trunc_idx[:, 1]] if len(self.trunc_idx) else keep[:0]
        idx = self.trunc_idx[tmask].clone()
        if len(idx):
            idx[:, 1] = new_col[idx[:, 1]]
        return UnrollBatch(
            self.entries,
            self.versions[keep.cpu().numpy()],
            self.obs[:, cols],
            self.action[:, cols],
            self.reward[:, cols],
            self.done[:, cols],
            self.logits[:, cols],
            self.trunc_obs[tmask],
            idx,
            None if self.value is None else self.value[:, cols],
        )


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
        value=t(cat("value")) if "value" in entries[0].data else None,
    )


class UnrollLoader:
    """A thread that reads ``consumer``, stacks entries into batches of at least ``unrolls``
    unrolls on ``device`` and queues up to two of them; :meth:`used` hands back the entries
    of a batch the learner is done with, acknowledged by the thread (off the gradient path).
    ``fail`` is called (from the thread) if it cannot go on.

    With ``held`` the thread starts reading a batch only while fewer than ``held`` of its
    batches wait unused (queued or in the learner's hands), and reads no more entries than
    the batch needs: in a pool whose actors make exactly one batch per version (PPO's
    ``pace_actors``) a learner that read ahead would take another learner's share, and
    neither could update again."""

    def __init__(
        self,
        consumer: StreamConsumer,
        unrolls: int,
        device: torch.device,
        fail: Callable[[str], None],
        held: int | None = None,
    ) -> None:
        self.consumer, self.unrolls, self.device, self._fail = consumer, unrolls, device, fail
        self._room = threading.Semaphore(held) if held else None
        self.batches: queue.Queue[UnrollBatch] = queue.Queue(maxsize=2)  # stacked, ready
        self._done: queue.SimpleQueue[list[Entry]] = queue.SimpleQueue()  # used: to acknowledge
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def used(self, entries: list[Entry]) -> None:
        self._done.put(entries)
        if self._room is not None:
            self._room.release()

    def get(self, timeout: float) -> UnrollBatch | None:
        try:
            return self.batches.get(timeout=timeout)
        except queue.Empty:
            return None

    def _ack_done(self) -> None:
        """Acknowledge the entries of every batch the gradient loop has finished with."""
        used: list[Entry] = []
        while True:
            try:
                used += self._done.get_nowait()
            except queue.Empty:
                break
        self.consumer.ack(used)

    def _load(self) -> None:
        pending: list[Entry] = []
        reserved = False  # a place among the ``held`` batches, taken before reading one
        try:
            while not self.stopping.is_set():
                self._ack_done()
                if self._room is not None and not reserved:
                    if not self._room.acquire(timeout=0.1):
                        continue
                    reserved = True
                pending += self.consumer.read(count=self._needed(pending))
                if sum(e.data["obs"].shape[1] for e in pending) < self.unrolls:
                    continue
                batch = stack_unrolls(pending, self.device)
                while not self.stopping.is_set():  # wait for room, unless stopping
                    with contextlib.suppress(queue.Full):
                        self.batches.put(batch, timeout=0.1)
                        break
                pending, reserved = [], False
        except Exception:
            self._fail("loader thread")

    def _needed(self, pending: list[Entry]) -> int | None:
        """Entries still needed for a batch (``None``: the consumer's count, before any
        entry says how many unrolls it holds)."""
        if self._room is None or not pending:
            return None
        have = sum(e.data["obs"].shape[1] for e in pending)
        return max(1, -(-(self.unrolls - have) // pending[-1].data["obs"].shape[1]))

    def start(self) -> None:
        self.stopping.clear()
        self._thread = threading.Thread(target=self._load, name="loader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ack_done()
        self.consumer.close()
