"""The unroll learners' loader (IMPALA, PPO): a child process that reads the trajectory
stream's consumer group, decodes entries and stacks them into batches straight into a ring
of shared-memory slots (:class:`qrl.replay.ring.SlotRing`), and acknowledges a batch's
entries once the learner gives its slot back (after the update that used it).

Like the replay learners' samplers (:mod:`qrl.replay.sampler`) it runs apart from the
gradient loop's GIL: a loader thread in the learner process held the IMPALA learner to
0.66-0.71 of the same learner fed from memory (notes/benchmarks-notebook.md, "Learners fed
through Redis"; the process: docs/benchmarks.md, "Learner feed"). It is started with
``spawn`` and imports no torch.

A batch holds at least ``unrolls`` unrolls (columns): its entries are the fewest that make
them, so a batch has fewer than ``unrolls + per_entry`` columns. The loader reads only for
slots the learner has given back, no more entries than their batches still need: with one
slot (PPO's ``pace_actors``) it reads nothing ahead of the batch in the learner's hands, so
in a pool whose actors make exactly one batch per version no learner takes another's share.

Each read is a round trip, which far from Redis (5 ms) was most of the loader's time, and the
loader then held the learner and, through the stream's room, the actors back
(notes/benchmarks-notebook.md, "Many machines"): so one read asks for every free slot's entries
(the result: docs/benchmarks.md, "Many machines"), and a given-back slot's acknowledgement goes
in the round trip of the read that follows it
(:meth:`qrl.wire.streams.StreamConsumer.defer_ack`; at once when no slot is free to read for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import redis

from qrl.replay.feed import Feed, feeding
from qrl.replay.ring import Column, SlotRing
from qrl.wire import clock
from qrl.wire.keys import RunKeys
from qrl.wire.schema import Schema
from qrl.wire.streams import Entry, StreamConsumer


@dataclass
class Stacked:
    """Entries' unrolls side by side (time-major: ``[T(+1), B, ...]``) as numpy arrays."""

    cols: dict[str, np.ndarray]  # obs, action (int64), reward, done, logits (, value)
    versions: np.ndarray  # behaviour policy version per unroll
    trunc_obs: np.ndarray  # [K, ...] final observations of episodes cut by a time limit
    trunc_idx: np.ndarray  # [K, 2] int64, their steps (t, b): not terminated there
    slot: int | None = None  # the ring slot the columns are in


Out = Callable[[int, tuple[int, ...]], np.ndarray]  # (column number, shape) -> where it goes
_COLUMNS = ("obs", "action", "reward", "done", "logits", "value")
_FROM = {"done": "terminated"}  # the message field a column starts from, where not its own
_DTYPES = {
    "action": np.int64,
    "reward": np.float32,
    "done": np.bool_,
    "logits": np.float32,
    "value": np.float32,
}


def stack(datas: list[dict[str, Any]], out: Out | None = None) -> Stacked:
    """Concatenate decoded unroll messages along the batch axis, each column into
    ``out(column number, shape)`` (new arrays by default)."""
    b = sum(d["obs"].shape[1] for d in datas)

    def cat(name: str) -> np.ndarray:
        parts = [d[_FROM.get(name, name)] for d in datas]
        shape = (parts[0].shape[0], b, *parts[0].shape[2:])
        if out is not None:
            dst = out(_COLUMNS.index(name), shape)
        else:
            dst = np.empty(shape, _DTYPES.get(name, parts[0].dtype))
        return np.concatenate(parts, axis=1, out=dst)

    cols = {name: cat(name) for name in _COLUMNS if _FROM.get(name, name) in datas[0]}
    offsets = np.cumsum([0] + [d["obs"].shape[1] for d in datas[:-1]])
    moved = [
        d["trunc_idx"] + np.array([0, o], np.int32) for d, o in zip(datas, offsets, strict=True)
    ]
    idx = np.concatenate(moved).astype(np.int64)
    # termination wins: gymnasium's TimeLimit also says truncated on the limit's step when
    # the episode terminated there, and a terminal step does not bootstrap
    done = cols["done"]  # terminated so far
    cut = ~done[idx[:, 0], idx[:, 1]]
    done |= np.concatenate([d["truncated"] for d in datas], axis=1)
    return Stacked(
        cols,
        np.concatenate([np.full(d["obs"].shape[1], d["version"]) for d in datas]),
        np.concatenate([d["trunc_obs"] for d in datas], axis=0)[cut],
        idx[cut],
    )


@dataclass(frozen=True)
class LoaderSpec:
    """What the loader process needs (picklable: ``connect`` and ``schema`` are e.g.
    ``functools.partial`` objects)."""

    connect: Callable[[], redis.Redis]
    keys: RunKeys
    stream: str
    schema: Callable[[], Schema]
    unrolls: int  # at least this many unrolls a batch
    per_entry: int  # at most this many in an entry
    unroll: int  # steps T
    obs_shape: tuple[int, ...]
    obs_dtype: str
    n_actions: int
    claim_idle_ms: int
    nice: int = 0  # added to the loader process's niceness

    def columns(self) -> list[Column]:
        t, most = self.unroll, self.unrolls + self.per_entry - 1
        shapes = {"obs": (t + 1, most, *self.obs_shape), "logits": (t, most, self.n_actions)}
        dtypes = {**_DTYPES, "obs": np.dtype(self.obs_dtype)}
        fields = self.schema().fields  # the columns of the fields the message carries
        names = [n for n in _COLUMNS if _FROM.get(n, n) in fields]
        return [(n, dtypes[n], shapes.get(n, (t, most))) for n in names]


class Loader(Feed):
    """The learner's handle on its loader process, filling a ring of ``slots`` slots."""

    def __init__(self, spec: LoaderSpec, slots: int) -> None:
        ctx = clock.current().helpers()
        super().__init__(
            ctx, SlotRing(ctx, spec.columns(), slots), _loader_main, [(spec,)], ["loader process"]
        )
        self._cols: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self._no_trunc = (
            np.zeros((0, *spec.obs_shape), spec.obs_dtype),
            np.zeros((0, 2), np.int64),
        )

    def get(self, timeout: float) -> Stacked | None:  # type: ignore[override]
        """The next batch (its columns in a ring slot: :meth:`used` when done), ``None`` if
        none came within ``timeout``; raises ``RuntimeError`` if the loader died or failed."""
        if (item := super().get(timeout)) is None:
            return None
        slot, (b, versions, trunc) = item
        if (slot, b) not in self._cols:  # views of the slot's columns for b unrolls
            self._cols[slot, b] = {
                name: self.ring.array(slot, i, (most[0], b, *most[2:]))
                for i, (name, _, most) in enumerate(self.ring.columns)
            }
        obs, idx = self._no_trunc
        if trunc is not None:  # copies: arrays over bytes are read-only, torch wants to write
            obs = np.frombuffer(trunc[0], obs.dtype).reshape(-1, *obs.shape[1:]).copy()
            idx = np.frombuffer(trunc[1], np.int64).reshape(-1, 2).copy()
        return Stacked(self._cols[slot, b], np.frombuffer(versions, np.int64), obs, idx, slot)

    def waiting(self) -> bool:
        """Whether a batch is ready."""
        return self.ring.ready()

    def used(self, slot: int) -> None:
        """The learner is done with ``slot``'s batch: its entries are acknowledged."""
        self.ring.release(slot)


def _batch(pending: list[Entry], unrolls: int) -> int:
    """How many of ``pending``'s first entries make a batch of at least ``unrolls`` unrolls
    (0: not enough yet); with the last one it passes ``unrolls``, not before."""
    have = 0
    for n, e in enumerate(pending, 1):
        have += e.data["obs"].shape[1]
        if have >= unrolls:
            return n
    return 0


def _loader_main(spec: LoaderSpec, ring: SlotRing, halt: Any, parent: int) -> None:
    with feeding(ring, parent, spec.nice):
        consumer = StreamConsumer(
            spec.connect(),
            spec.keys,
            spec.stream,
            spec.schema(),
            count=1,
            block_ms=100,
            claim_idle_ms=spec.claim_idle_ms,
        )
        held: dict[int, list[Entry]] = {}  # the entries of each slot in the learner's hands
        free: list[int] = []
        pending: list[Entry] = []

        def given_back(wait: float) -> None:
            # acknowledged with the next read, in its round trip (a read follows at once:
            # the slot is free), or below, at once, when no slot is free to read for
            while (given := ring.take(0, wait)) is not None:
                consumer.defer_ack(held.pop(given[0], []))
                free.append(given[0])
                wait = 0.0

        while not halt.is_set():
            given_back(0.0 if free else 0.1)  # acknowledged at least every 0.1 s
            if not free:
                consumer.ack()
                continue
            n = _batch(pending, spec.unrolls)
            if not n:  # one read for every free slot: each read is a round trip
                have = sum(e.data["obs"].shape[1] for e in pending)
                need = len(free) * spec.unrolls - have
                pending += consumer.read(count=-(-need // spec.per_entry))
                continue
            slot = free.pop()
            s = stack([e.data for e in pending[:n]], partial(ring.array, slot))
            held[slot], pending = pending[:n], pending[n:]
            # the small parts in the message, as bytes (the learner's side of every update
            # makes arrays of them without a copy)
            trunc = None
            if len(s.trunc_idx):
                trunc = (
                    s.trunc_obs.astype(spec.obs_dtype, copy=False).tobytes(),
                    s.trunc_idx.tobytes(),
                )
            ring.hand(slot, (len(s.versions), s.versions.astype(np.int64).tobytes(), trunc))
        given_back(0.0)  # the last batches the learner finished with
        consumer.close()  # (acknowledges them)
