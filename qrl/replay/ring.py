"""Batches handed between the learner's data processes and the learner through shared
memory.

A ring of ``slots`` preallocated slots, each with room for one batch as columns, lives in one
block of shared memory made before the data processes start (a ``multiprocessing``
RawArray: a ``spawn`` child receives a handle to the same pages). Each slot belongs to one
data process (its owner). The owner writes a batch into its slot and sends the learner the
slot's index; the learner reads the columns where they are (on CPU its tensors are views of
the slot) and sends the index back to the slot's owner, which may then fill the slot again.
Only indices and a few small arrays cross between the processes; the number of slots bounds
how far the owners run ahead.

:class:`SlotRing` is the ring; :class:`BatchRing` holds the replay's batches (the sampler
processes of :mod:`qrl.replay.sampler`: record columns, importance weights, and the new
priorities the learner writes back); the unroll learners' loader
(:mod:`qrl.learners.loader`) keeps its own columns.
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import struct
from typing import Any

import msgpack
import numpy as np

from qrl.replay.store import Sample
from qrl.wire import clock

ALIGN = 64  # each column starts on a cache line
_HEAD = struct.Struct("!I")  # a message's length
NAP_S = 0.0005  # the longest an owner sleeps between looks for a slot given back
NAP_FIRST = 0.00005  # its first sleep (then each twice the one before)
NAPS_S = 0.003  # how long it naps before it waits in the pipe's poll (a learner gone quiet)


class Channel:
    """One way between processes over a pipe. ``put`` is one write by the caller: an
    ``mp.Queue``'s feeder thread would wake in the learner process on every update and contend
    for its GIL (notes/benchmarks-notebook.md, "The learner's data path"). One reader; writers
    share a lock. No more messages are in flight than there are slots, a few numbers each (and
    a batch's ids): a ``put`` waits only if they fill the pipe (64 KiB on Linux), until the
    reader takes one.

    A message (numbers, bytes, strings, lists of them) is its length and its msgpack. The
    reader takes what the pipe holds into a buffer and returns a message only once it is
    whole, so a writer killed in the middle of one (a write of more than 4 KiB, the pipe's
    atomic size, can be cut) leaves a part that ``get`` never blocks on: it still returns
    ``None`` after ``timeout``, and the reader's side learns that the writer died
    (:class:`qrl.replay.feed.Feed`).

    ``nap`` > 0: for its first ``naps`` seconds of waiting the reader sleeps (up to ``nap``
    seconds at a time) between looks at the pipe, outside its wait queue, so a ``put``
    meanwhile has no process to wake: waking one on the other CPU cost the learner's give-back
    of a slot ~20 us of its ~30 here (notes/benchmarks-notebook.md, "The owners nap"). Then it
    waits in the pipe's poll: napping on while the writer is quiet would burn CPU for nothing
    (~7% of a core at 0.5 ms naps here)."""

    def __init__(self, ctx: Any, nap: float = 0.0, naps: float = NAPS_S) -> None:
        self._r, self._w = ctx.Pipe(duplex=False)  # (its ends travel to spawned children)
        self._lock = ctx.Lock()
        self._buf = bytearray()  # the reader's: bytes of messages not yet whole
        self.nap, self.naps = nap, naps
        self._poll: select.poll | None = None  # the reader's, made where it reads

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_poll": None}

    def put(self, msg: Any) -> None:
        data = msgpack.packb(msg)
        left = memoryview(_HEAD.pack(len(data)) + data)
        with self._lock:
            while left:
                left = left[os.write(self._w.fileno(), left) :]

    def get(self, timeout: float) -> Any | None:
        """The next whole message, ``None`` if none is whole within ``timeout``."""
        c = clock.current()
        end = c.now() + timeout
        while (n := self._whole()) is None:
            if not self._wait(c, end):
                return None
            self._read()
        msg = msgpack.unpackb(self._buf[_HEAD.size : n])
        del self._buf[:n]
        return msg

    def ready(self) -> bool:
        """Whether a whole message waits."""
        while self._readable(0.0):
            self._read()
        return self._whole() is not None

    def _readable(self, timeout: float) -> bool:
        if self._poll is None:  # (a Connection's poll makes a selector on every call)
            self._poll = select.poll()
            self._poll.register(self._r.fileno(), select.POLLIN)
        return bool(self._poll.poll(timeout * 1e3))

    def _wait(self, c: clock.Clock, end: float) -> bool:
        """Whether the pipe holds bytes to read before ``end`` (a time of the clock ``c``,
        :mod:`qrl.wire.clock`)."""
        if self.nap:
            naps_end, nap = min(end, c.now() + self.naps), NAP_FIRST
            while not self._readable(0.0):
                if (left := naps_end - c.now()) <= 0:
                    break
                c.sleep(min(nap, left))
                nap = min(2 * nap, self.nap)
            else:
                return True
        return c.poll(self._readable, end)

    def _read(self) -> None:
        self._buf += os.read(self._r.fileno(), 1 << 16)

    def _whole(self) -> int | None:
        """Where the buffer's first message ends, if it is whole."""
        if len(self._buf) < _HEAD.size:
            return None
        end = _HEAD.size + _HEAD.unpack_from(self._buf)[0]
        return end if len(self._buf) >= end else None


Column = tuple[str, np.dtype, tuple[int, ...]]  # name, dtype, the largest shape a slot holds


class SlotRing:
    """``slots`` slots of the same ``columns``, slot ``i`` owned by process ``i % owners``;
    ``ctx`` a multiprocessing context."""

    def __init__(self, ctx: Any, columns: list[Column], slots: int, owners: int = 1) -> None:
        self.columns = [(n, np.dtype(d), tuple(shape)) for n, d, shape in columns]
        self.slots = slots
        sizes = [-(-d.itemsize * math.prod(s) // ALIGN) * ALIGN for _, d, s in self.columns]
        self.offsets = [0, *np.cumsum(sizes)[:-1].tolist()]
        self.slot_bytes = int(sum(sizes))
        self.mem = ctx.RawArray(ctypes.c_uint8, slots * self.slot_bytes)
        self.full = Channel(ctx)  # owners -> learner: (slot, message) or last words
        # learner -> a slot's owner, which naps: giving a slot back wakes no process
        self.free = [Channel(ctx, nap=NAP_S) for _ in range(owners)]
        for i in range(slots):
            self.free[i % owners].put((i, None))
        self._base: np.ndarray | None = None
        self._views: list[dict[str, np.ndarray]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_base": None, "_views": None}  # a child makes its own views

    @property
    def address(self) -> int:
        return ctypes.addressof(self.mem)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def array(self, slot: int, column: int, shape: tuple[int, ...]) -> np.ndarray:
        """The first ``prod(shape)`` items of ``slot``'s column number ``column`` as one
        contiguous array of ``shape``."""
        if self._base is None:
            self._base = np.frombuffer(self.mem, np.uint8)
        _, d, most = self.columns[column]
        n = math.prod(shape)
        assert n <= math.prod(most), (shape, most)
        at = slot * self.slot_bytes + self.offsets[column]
        return self._base[at : at + n * d.itemsize].view(d).reshape(shape)

    def view(self, slot: int) -> dict[str, np.ndarray]:
        """The columns of ``slot`` at their largest shapes."""
        if self._views is None:
            self._views = [
                {n: self.array(s, i, shape) for i, (n, _, shape) in enumerate(self.columns)}
                for s in range(self.slots)
            ]
        return self._views[slot]

    # -- an owner's side
    def take(self, owner: int, timeout: float) -> tuple[int, Any] | None:
        """A slot of ``owner``'s given back: ``(index, the learner's note)``, or ``None`` if
        none came within ``timeout``."""
        return self.free[owner].get(timeout)

    def hand(self, slot: int, msg: Any) -> None:
        """Hand ``slot`` to the learner, with ``msg`` (what the columns cannot say)."""
        self.full.put((slot, msg))

    def last_words(self, why: str) -> None:
        """Tell the learner this owner cannot go on."""
        self.full.put(why)

    # -- the learner's side
    def get(self, timeout: float) -> tuple[int, Any] | str | None:
        """``(slot, message)`` of the next batch, an owner's last words, or ``None``."""
        return self.full.get(timeout)

    def ready(self) -> bool:
        """Whether a batch (or last words) waits."""
        return self.full.ready()

    def release(self, slot: int, note: Any = None) -> None:
        """Give ``slot`` back to its owner, with ``note``."""
        self.free[slot % len(self.free)].put((slot, note))


class BatchRing(SlotRing):
    """Replay batches of ``rows`` rows of the structured ``dtype``'s fields (a field named
    ``ok``, the frame layout's decode flag, is not kept), importance weights and new
    priorities; slot ``i`` filled by sampler ``i % owners``. The note a slot comes back with
    says whether the learner wrote new priorities into it."""

    def __init__(self, ctx: Any, dtype: np.dtype, rows: int, slots: int, owners: int = 1) -> None:
        names = [n for n in dtype.names or () if n != "ok"]
        columns: list[Column] = [
            *((n, dtype.fields[n][0].base, (rows, *dtype.fields[n][0].shape)) for n in names),
            ("weights", np.dtype(np.float32), (rows,)),
            ("priority", np.dtype(np.float32), (rows,)),
        ]
        super().__init__(ctx, columns, slots, owners)
        self.rows = rows

    # -- a sampler's side
    def put(self, slot: int, s: Sample) -> None:
        """Hand ``slot`` to the learner with ``s`` in it: its records decoded into the slot
        (:meth:`qrl.replay.store.RecordLayout.decode`'s ``out``), its weights written here."""
        self.view(slot)["weights"][: len(s.ids)] = s.weights
        self.hand(slot, (s.ids, int(s.size)))

    # -- the learner's side
    def get(self, timeout: float) -> Sample | str | None:  # type: ignore[override]
        """The next batch as a :class:`Sample` whose arrays are views of its slot (``slot``
        set: give it back with :meth:`release`), a sampler's last words, or ``None``."""
        item = super().get(timeout)
        if item is None or isinstance(item, str):
            return item
        slot, (ids, size) = item
        cols = {name: a[: len(ids)] for name, a in self.view(slot).items()}
        weights, _ = cols.pop("weights"), cols.pop("priority")
        return Sample(ids, cols, weights, np.zeros(0), size, slot=slot)

    def release(self, slot: int | None, priorities: np.ndarray | None = None) -> None:  # type: ignore[override]
        """Give ``slot`` back to its sampler, with the batch's new ``priorities`` (one per
        row, written to the replay by the sampler) or none."""
        if slot is None:
            return
        if priorities is not None:
            self.view(slot)["priority"][: len(priorities)] = priorities
        super().release(slot, priorities is not None)
