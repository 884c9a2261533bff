"""The unroll learners' batch source (IMPALA, PPO): the batch of unrolls as tensors, and the
loader process (:mod:`qrl.learners.loader`) that reads, decodes and stacks stream entries
into ring slots while the gradient loop runs. Entries are acknowledged only after the update
that used them (:meth:`UnrollSource.done`). An algorithm's ``admit`` filter drops the
unrolls it will not learn from (by their policy lag) and counts them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import redis
import torch

from qrl.learners.fed import FedSource, tensor_on
from qrl.learners.loader import Loader, LoaderSpec, Stacked, stack
from qrl.learners.rule import Update
from qrl.rl.envspec import EnvSpec
from qrl.runtime.config import Unrolls
from qrl.wire.keys import RunKeys
from qrl.wire.schema import Schema
from qrl.wire.streams import Entry

SLOTS = 4  # batches loaded ahead of the learner (with the one in its hands), unpaced


@dataclass
class UnrollBatch:
    versions: np.ndarray  # behaviour policy version per unroll
    obs: torch.Tensor  # [T+1, B, ...]
    action: torch.Tensor  # [T, B]
    reward: torch.Tensor
    done: torch.Tensor
    logits: torch.Tensor  # [T, B, A]
    trunc_obs: torch.Tensor  # [K, ...] final observations of episodes cut by a time limit
    trunc_idx: torch.Tensor  # [K, 2] their steps (t, b): not terminated there
    value: torch.Tensor | None = None  # [T, B] behaviour value estimates (PPO)
    slot: int | None = None  # the loader's ring slot its tensors are in (on CPU: views)

    @classmethod
    def of(cls, s: Stacked, device: torch.device) -> UnrollBatch:
        """``s`` as tensors on ``device``: on CPU views of its arrays (no copy), on CUDA
        asynchronous copies (from pinned memory)."""
        t = tensor_on(device)
        c = s.cols
        return cls(
            s.versions,
            t(c["obs"]),
            t(c["action"]),
            t(c["reward"]),
            t(c["done"]),
            t(c["logits"]),
            t(s.trunc_obs),
            t(s.trunc_idx),
            t(c["value"]) if "value" in c else None,
            s.slot,
        )

    def own(self) -> UnrollBatch:
        """A copy in memory of its own (kept past its slot's release)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        return UnrollBatch(**{**copy, "slot": None})

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
            self.versions[keep.cpu().numpy()],
            self.obs[:, cols],
            self.action[:, cols],
            self.reward[:, cols],
            self.done[:, cols],
            self.logits[:, cols],
            self.trunc_obs[tmask],
            idx,
            None if self.value is None else self.value[:, cols],
            self.slot,
        )


def stack_unrolls(entries: list[Entry], device: torch.device) -> UnrollBatch:
    """Concatenate the entries' unrolls along the batch axis."""
    return UnrollBatch.of(stack([e.data for e in entries]), device)


class Admit(Protocol):
    """An algorithm's filter of the unrolls it learns from (IMPALA's, PPO's)."""

    def __call__(self, b: UnrollBatch, updates: int) -> UnrollBatch | None:
        """``b``, or only the unrolls of it to learn from at ``updates`` updates (``None``:
        none)."""

    def metrics(self) -> dict[str, float]: ...


class UnrollSource(FedSource):
    """Batches of unrolls from ``stream`` (its messages of ``schema(obs_shape, obs_dtype,
    n_actions, unroll, envs)``), ``slots`` loaded ahead, by a loader process ``nice`` below
    the learner; ``admit`` filters each batch."""

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        keys: RunKeys,
        cfg: Unrolls,
        env: EnvSpec,
        device: torch.device,
        *,
        stream: str,
        schema: Callable[..., Schema],
        admit: Admit,
        slots: int = SLOTS,
        nice: int = 0,
    ) -> None:
        super().__init__(device)
        shape, dtype, n = env.obs_shape, env.obs_dtype, env.discrete_actions()
        self.spec = LoaderSpec(
            connect,
            keys,
            stream,
            partial(schema, shape, dtype, n, cfg.unroll, cfg.envs_per_actor),
            cfg.batch_unrolls // cfg.learners,
            cfg.envs_per_actor,
            cfg.unroll,
            tuple(shape),
            str(dtype),
            n,
            cfg.claim_idle_ms,
            nice,
        )
        self.slots, self.admit = slots, admit
        self.feed: Loader | None = None

    def open(self) -> Loader:
        return Loader(self.spec, self.slots)

    def take(self, timeout: float) -> UnrollBatch | None:
        """The next batch as tensors on the device, ``None`` if none came within
        ``timeout`` (or the loader failed: then the learner stops)."""
        return self.fetch(timeout, lambda s: UnrollBatch.of(s, self.device))

    def next(self, timeout: float, updates: int) -> UnrollBatch | None:
        """The next batch, filtered (one left with no unrolls is used up at once)."""
        b = self.take(timeout)
        if b is None:
            return None
        kept = self.admit(b, updates)
        if kept is None:
            self.used(b)
        return kept

    def waiting(self) -> bool:
        """Whether a batch is loaded, ready to take."""
        return self.feed is not None and self.feed.waiting()

    def done(self, b: UnrollBatch, update: Update | None) -> None:
        """Used, whether or not a step was taken on it (the same unrolls would give the same
        loss again)."""
        self.used(b)

    def used(self, b: UnrollBatch) -> None:
        """Done with ``b``: its slot goes back, its entries are acknowledged."""
        if b.slot is not None and self.feed is not None:
            self.feed.used(b.slot)

    def metrics(self) -> dict[str, float]:
        return self.admit.metrics()
