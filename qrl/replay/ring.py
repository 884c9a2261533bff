"""Batches handed between the sampler processes and the learner through shared memory.

A ring of ``slots`` preallocated slots, each with room for one batch as columns (one array
per record field, the importance weights and the new priorities), lives in one block of
shared memory made before the samplers start (a ``multiprocessing`` RawArray: a ``spawn``
child receives a handle to the same pages). Each slot belongs to one sampler process. The
sampler decodes a batch into its slot and sends the learner the slot's index; the learner
reads the columns where they are (on CPU its tensors are views of the slot), writes the
batch's new priorities into the slot and sends the index back to the slot's sampler, which
writes them to the replay and fills the slot again. Only indices, counts and the batch's
ids cross between the processes; the number of slots bounds how far the samplers run
ahead.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from qrl.replay.store import Sample

ALIGN = 64  # each column starts on a cache line


class Channel:
    """One way between processes over a pipe. ``put`` is one write by the caller: an
    ``mp.Queue``'s feeder thread would wake in the learner process on every update and
    contend for its GIL (docs/benchmarks.md, "The learner's data path"). ``get`` returns
    ``None`` after ``timeout``. One reader; writers share a lock. No more messages are in
    flight than there are slots, a few numbers each (and a batch's ids): a ``put`` waits
    only if they fill the pipe (64 KiB on Linux), until the reader takes one."""

    def __init__(self, ctx: Any) -> None:
        self._r, self._w = ctx.Pipe(duplex=False)
        self._lock = ctx.Lock()

    def put(self, msg: Any) -> None:
        with self._lock:
            self._w.send(msg)

    def get(self, timeout: float) -> Any | None:
        return self._r.recv() if self._r.poll(timeout) else None


class BatchRing:
    """``slots`` slots of ``rows`` rows of the structured ``dtype``'s fields (a field named
    ``ok``, the frame layout's decode flag, is not kept), slot ``i`` owned by sampler
    ``i % owners``; ``ctx`` a multiprocessing context."""

    def __init__(self, ctx: Any, dtype: np.dtype, rows: int, slots: int, owners: int = 1) -> None:
        names = [n for n in dtype.names or () if n != "ok"]
        self.columns: list[tuple[str, np.dtype, tuple[int, ...]]] = [
            *((n, dtype.fields[n][0].base, dtype.fields[n][0].shape) for n in names),
            ("weights", np.dtype(np.float32), ()),
            ("priority", np.dtype(np.float32), ()),
        ]
        self.rows, self.slots = rows, slots
        sizes = [-(-rows * d.itemsize * math.prod(s) // ALIGN) * ALIGN for _, d, s in self.columns]
        self.offsets = [0, *np.cumsum(sizes)[:-1].tolist()]
        self.slot_bytes = int(sum(sizes))
        self.mem = ctx.RawArray(ctypes.c_uint8, slots * self.slot_bytes)
        self.full = Channel(ctx)  # samplers -> learner: (slot, ids, replay size) or last words
        self.free = [Channel(ctx) for _ in range(owners)]  # learner -> a slot's sampler
        for i in range(slots):
            self.free[i % owners].put((i, False))
        self._views: list[dict[str, np.ndarray]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_views": None}  # a child makes its own views of the pages

    @property
    def address(self) -> int:
        return ctypes.addressof(self.mem)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def view(self, slot: int) -> dict[str, np.ndarray]:
        """The columns of ``slot``, each ``rows`` long."""
        if self._views is None:
            base = np.frombuffer(self.mem, np.uint8)

            def column(s: int, off: int, d: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
                at = s * self.slot_bytes + off
                return base[at : at + self.rows * d.itemsize * math.prod(shape)].view(d)

            self._views = [
                {
                    name: column(s, off, d, shape).reshape(self.rows, *shape)
                    for (name, d, shape), off in zip(self.columns, self.offsets, strict=True)
                }
                for s in range(self.slots)
            ]
        return self._views[slot]

    # -- a sampler's side
    def take(self, owner: int, timeout: float) -> tuple[int, bool] | None:
        """A slot of ``owner``'s given back: ``(index, whether the learner wrote new
        priorities into it)``, or ``None`` if none came within ``timeout``."""
        return self.free[owner].get(timeout)

    def put(self, slot: int, s: Sample) -> None:
        """Hand ``slot`` to the learner with ``s`` in it: its records decoded into the slot
        (:meth:`qrl.replay.store.RecordLayout.decode`'s ``out``), its weights written here."""
        self.view(slot)["weights"][: len(s.ids)] = s.weights
        self.full.put((slot, s.ids, s.size))

    # -- the learner's side
    def get(self, timeout: float) -> Sample | str | None:
        """The next batch as a :class:`Sample` whose arrays are views of its slot (``slot``
        set: give it back with :meth:`release`), a sampler's last words, or ``None``."""
        item = self.full.get(timeout)
        if item is None or isinstance(item, str):
            return item
        slot, ids, size = item
        cols = {name: a[: len(ids)] for name, a in self.view(slot).items()}
        weights, _ = cols.pop("weights"), cols.pop("priority")
        return Sample(ids, cols, weights, np.zeros(0), size, slot=slot)

    def release(self, slot: int | None, priorities: np.ndarray | None = None) -> None:
        """Give ``slot`` back to its sampler, with the batch's new ``priorities`` (one per
        row, written to the replay by the sampler) or none."""
        if slot is None:
            return
        if priorities is not None:
            self.view(slot)["priority"][: len(priorities)] = priorities
        self.free[slot % len(self.free)].put((slot, priorities is not None))
