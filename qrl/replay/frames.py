"""Stacked-frame experience (Atari): each frame stored once, LZ4-compressed, in Redis.

An n-step transition over stacked frames (obs ``[stack, H, W]`` uint8) would carry its
frames twice, and consecutive transitions share ``stack - 1`` of them. Instead:

* The actor sends a batch as **chunks**, one per env slot (:func:`pack_frames`): the
  distinct frames of that slot's run of transitions (deduplicated by content, which also
  folds the reset padding of a frame stack), and per transition ``2 x stack`` references
  into them (obs frames, then next-obs frames). A chunk is self-contained.
* The replay filler stores each chunk as one hash field of ``replay:frames`` named by the
  id of its first transition (:func:`encode_chunk`): a header, the fixed-size records of
  its transitions (action, n-step return, discount, references), then its frames in LZ4
  blocks of ``FRAMES_PER_BLOCK`` consecutive frames (LZ4 finds the next frame in the
  previous one, so a block costs far less than its frames compressed one by one), each with
  its size and CRC-32 in a table before them.
  ``replay:index`` is a ring of ``capacity`` u32: slot ``id % capacity`` holds the distance
  from transition ``id`` to the first transition of its chunk.
* Priorities and FIFO eviction are the plain replay's (``replay:prio``, consecutive ids).
  Evicting transitions ``[lo, new_lo)`` deletes the chunks that start before the chunk of
  ``new_lo``: exactly those with no transition left.
* Sampling is the plain replay's scripts with another ``records`` function: each sampled id
  comes with its chunk (one Lua call). The sampler checks what the transition needs of it (the
  header and sizes, the record's values and references, the CRC-32 of each LZ4 block its frames
  are in, those blocks decompressed to their exact expected size) and decompresses only those
  blocks (a CRC over the whole chunk cost every transition its chunk's bytes again; trimming
  the chunk in Lua cost Redis more CPU than it saved the sampler: notes/benchmarks-notebook.md,
  "Only the blocks a transition needs"). A transition whose chunk is missing or corrupt is
  dropped from the batch and removed from the replay (dead-lettered and counted, as
  :meth:`PrioritizedReplay.reject` does).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lz4.block
import numpy as np

from qrl.algos.apex_family.messages import check_chunks
from qrl.replay.store import (
    P_HI,
    P_LO,
    Columns,
    PrioritizedReplay,
    RecordLayout,
    Rows,
    sampling_scripts,
)
from qrl.wire.scripts import Lua

log = logging.getLogger(__name__)

FRAMES_PER_BLOCK = 8
# transitions per chunk at most: a sampled transition fetches its whole chunk, and the
# references and counts are u16
CHUNK_MAX = 256
# version, frames per block, transitions, frames, CRC-32 of the records and block table
_HEAD = struct.Struct("<BBHHI")
_VERSION = 2
_TABLE = np.dtype([("size", "<u4"), ("crc", "<u4")])  # per LZ4 block


def is_frame_stack(obs_shape: tuple[int, ...], obs_dtype: str) -> bool:
    """Observations stored as deduplicated frames: ``(stack, H, W)`` uint8."""
    return len(obs_shape) == 3 and np.dtype(obs_dtype) == np.uint8


def layout_for(obs_shape: tuple[int, ...], obs_dtype: str, n_actions: int) -> RecordLayout:
    """The replay layout of an env's observations."""
    if is_frame_stack(obs_shape, obs_dtype):
        return FrameLayout(obs_shape, obs_dtype, n_actions)
    return RecordLayout(obs_shape, obs_dtype, n_actions=n_actions)


def replay_class(layout: RecordLayout) -> type[PrioritizedReplay]:
    return FrameReplay if isinstance(layout, FrameLayout) else PrioritizedReplay


def pack_frames(obs: np.ndarray, next_obs: np.ndarray, slots: np.ndarray) -> dict[str, Any]:
    """Transitions ``obs[i] -> next_obs[i]`` of env slots ``slots[i]`` (each slot's in time
    order) as chunks of at most ``CHUNK_MAX`` transitions: ``frames``, ``counts``, ``refs``
    and ``order``, the permutation that puts the transitions in chunk order (apply it to
    their other fields)."""
    order = np.argsort(slots, kind="stable")
    frames: list[np.ndarray] = []
    counts, refs = [], np.empty((len(order), 2 * obs.shape[1]), np.uint16)
    runs = np.split(order, np.flatnonzero(np.diff(slots[order])) + 1)
    chunks = [run[s : s + CHUNK_MAX] for run in runs for s in range(0, len(run), CHUNK_MAX)]
    row = 0
    for chunk in chunks:
        index: dict[bytes, int] = {}
        start = len(frames)
        for i in chunk:
            for k, f in enumerate((*obs[i], *next_obs[i])):
                key = f.tobytes()
                j = index.get(key)
                if j is None:
                    j = index[key] = len(frames) - start
                    frames.append(f)
                refs[row, k] = j
            row += 1
        counts.append((len(chunk), len(frames) - start))
    return {
        "frames": np.stack(frames),
        "counts": np.asarray(counts, np.int32),
        "refs": refs,
        "order": order,
    }


@dataclass
class FrameBatch:
    """Chunks ready for :meth:`FrameReplay.insert` (the fields of an ``apex.frames``
    message)."""

    frames: np.ndarray
    counts: np.ndarray
    refs: np.ndarray
    action: np.ndarray
    ret: np.ndarray
    disc: np.ndarray

    def __len__(self) -> int:
        return len(self.refs)

    @classmethod
    def of(cls, msg: dict[str, Any]) -> FrameBatch:
        """From a decoded ``apex.frames`` message."""
        return cls(*(msg[k] for k in ("frames", "counts", "refs", "action", "ret", "disc")))


def _record_dtype(stack: int) -> np.dtype:
    return np.dtype(
        [("action", "<i4"), ("ret", "<f4"), ("disc", "<f4"), ("refs", "<u2", 2 * stack)]
    )


@functools.cache
def _record_struct(stack: int) -> struct.Struct:
    """One record of :func:`_record_dtype`, read without numpy's per-field overhead."""
    return struct.Struct(f"<iff{2 * stack}H")


def encode_chunk(frames: np.ndarray, records: np.ndarray) -> bytes:
    """One chunk as stored: header (with the CRC-32 of the records and table), records, the
    table of LZ4 block sizes and CRC-32s, LZ4 blocks."""
    g = FRAMES_PER_BLOCK
    blocks = [
        lz4.block.compress(frames[i : i + g].tobytes(), store_size=False)
        for i in range(0, len(frames), g)
    ]
    table = np.asarray([(len(b), zlib.crc32(b)) for b in blocks], _TABLE)
    meta = records.tobytes() + table.tobytes()
    head = _HEAD.pack(_VERSION, g, len(records), len(frames), zlib.crc32(meta))
    return b"".join([head, meta, *blocks])


@dataclass
class FrameLayout(RecordLayout):
    """The sampled batch of the frame-stack replay: the plain record fields plus ``ok``
    (False for a transition whose chunk was missing or failed a check)."""

    n_actions: int = 2**31 - 1
    rec: np.dtype = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dtype = np.dtype(
            [*((n, self.dtype.fields[n][0]) for n in self.dtype.names), ("ok", "?")]
        )
        self.rec = _record_dtype(self.obs_shape[0])
        self.frame_bytes = math.prod(self.obs_shape[1:])

    def items(self, msg: dict[str, Any]) -> FrameBatch:
        """The chunks of a decoded message of transitions over frames, as inserted."""
        return FrameBatch.of(msg)

    def unpack(self, records: list[Any]) -> np.ndarray:
        """Decode ``[rel, chunk]`` pairs (from the sampling scripts) into a batch with an
        ``ok`` flag per row (zeros where it is not)."""
        out = np.zeros(len(records), self.dtype)
        batch, ok = self.decode(records)
        out[ok] = batch
        return out

    def max_chunk(self) -> int:
        """The most bytes a chunk can take: ``CHUNK_MAX`` records and as many distinct
        frames as they can reference, in LZ4 blocks that did not compress at all."""
        frames = 2 * self.obs_shape[0] * CHUNK_MAX
        raw = FRAMES_PER_BLOCK * self.frame_bytes
        blocks = -(-frames // FRAMES_PER_BLOCK)
        per_block = _TABLE.itemsize + raw + raw // 255 + 16
        return _HEAD.size + CHUNK_MAX * self.rec.itemsize + blocks * per_block

    def decode(self, records: list[Any], out: Columns | None = None) -> tuple[Rows, np.ndarray]:
        """The transitions whose chunk passed every check, and which did: their stacks copied
        frame by frame from the decompressed LZ4 blocks straight into ``out`` (a ring slot's
        columns) if given, else into a new batch of records. (Joining a transition's blocks
        to gather from them copied its frames once more, into fresh, page-faulted memory.)"""
        batch = None
        if out is None:
            batch = np.zeros(len(records), self.dtype)
            out = {n: batch[n] for n in self.dtype.names or ()}
        obs, next_obs, s = out["obs"], out["next_obs"], self.obs_shape[0]
        ok, recs = np.zeros(len(records), bool), []
        for i, item in enumerate(records):
            try:
                r, refs, g, blocks = self._transition(item)
            except (ValueError, TypeError, IndexError, struct.error, lz4.block.LZ4BlockError):
                continue
            frames = {
                b: np.frombuffer(raw, np.uint8).reshape(-1, *self.obs_shape[1:])
                for b, raw in blocks.items()
            }
            o, n = obs[len(recs)], next_obs[len(recs)]
            for k, j in enumerate(refs):
                (o if k < s else n)[k % s] = frames[j // g][j % g]
            ok[i] = True
            recs.append(r)
        k = len(recs)
        for name, column in zip(("action", "ret", "disc"), zip(*recs, strict=True), strict=False):
            out[name][:k] = column  # (nothing when no transition passed)
        if batch is not None:
            batch = batch[:k]
            batch["ok"] = True
            return batch, ok
        return {n: out[n][:k] for n in ("obs", "action", "ret", "disc", "next_obs")}, ok

    def parse(self, blob: Any) -> tuple[np.ndarray, int, int, list[memoryview]]:
        """A whole stored chunk's records, frame count, frames per block and LZ4 blocks;
        raises ``ValueError`` unless its header, sizes and CRCs hold together."""
        g, n, f, crc, at, end = self._header(blob)
        if zlib.crc32(memoryview(blob)[_HEAD.size : end]) != crc:
            raise ValueError("chunk CRC")
        blocks, stop = _checked_blocks(blob, at, end, range((end - at) // _TABLE.itemsize))
        if stop != len(blob):
            raise ValueError("chunk size")
        return np.frombuffer(blob, self.rec, n, _HEAD.size), f, g, blocks

    def _header(self, blob: Any) -> tuple[int, int, int, int, int, int]:
        """A stored chunk's frames per block, transitions, frames, CRC of its records and
        table, and where its table and its blocks start; raises ``ValueError`` unless the
        header is of this version and the chunk is long enough for its records and table."""
        if not isinstance(blob, bytes) or len(blob) < _HEAD.size:
            raise ValueError("chunk missing")
        version, g, n, f, crc = _HEAD.unpack_from(blob)
        n_blocks = -(-f // g) if g else 0
        at = _HEAD.size + n * self.rec.itemsize
        end = at + _TABLE.itemsize * n_blocks
        if version != _VERSION or n < 1 or n_blocks < 1 or len(blob) < end:
            raise ValueError("chunk header")
        return g, n, f, crc, at, end

    def _block(self, block: Any, b: int, f: int, g: int) -> bytes:
        """LZ4 block ``b`` (frames ``b*g ..``) of a chunk of ``f`` frames, decompressed to
        exactly their expected size."""
        want = (min(f, (b + 1) * g) - b * g) * self.frame_bytes
        raw = lz4.block.decompress(block, uncompressed_size=want)
        if len(raw) != want:
            raise ValueError("LZ4 block size")
        return raw

    def chunk_frames(self, blob: bytes) -> np.ndarray:
        """Every frame of a stored chunk, in order."""
        _, f, g, blocks = self.parse(blob)
        raw = b"".join(self._block(block, b, f, g) for b, block in enumerate(blocks))
        return np.frombuffer(raw, np.uint8).reshape(-1, *self.obs_shape[1:])

    def _transition(self, item: Any) -> tuple[tuple[int, float, float], list[int], int, dict]:
        """A sampled transition's action, return and discount, its 2 x stack frame
        references, its chunk's frames per block, and the blocks its frames are in
        (decompressed); raises unless every check passes."""
        rel_b, blob = item
        g, n, f, _, at, end = self._header(blob)
        (rel,) = struct.unpack("<I", rel_b)
        if rel >= n:
            raise ValueError("chunk record missing")
        here = _HEAD.size + rel * self.rec.itemsize
        action, ret, disc, *refs = _record_struct(self.obs_shape[0]).unpack_from(blob, here)
        ok = 0 <= action < self.n_actions and math.isfinite(ret) and abs(ret) <= 1e6
        if not ok or not 0 <= disc <= 1 or max(refs) >= f:
            raise ValueError("chunk record out of bounds")
        need = sorted({j // g for j in refs})
        blocks, _ = _checked_blocks(blob, at, end, need)
        return (
            (action, ret, disc),
            refs,
            g,
            {b: self._block(block, b, f, g) for b, block in zip(need, blocks, strict=True)},
        )


def _checked_blocks(
    blob: bytes, at: int, end: int, which: Sequence[int]
) -> tuple[list[memoryview], int]:
    """LZ4 blocks ``which`` (increasing) of a chunk whose block table starts at ``at`` and
    blocks at ``end``, each checked against its CRC-32 (a block cut short by the chunk's end
    fails it), and where the last of them ends; raises ``ValueError`` on a mismatch."""
    table = np.frombuffer(blob, _TABLE, which[-1] + 1, at).tolist()
    starts = list(itertools.accumulate((size for size, _ in table), initial=end))
    view, blocks = memoryview(blob), []
    for b in which:
        block = view[starts[b] : starts[b + 1]]
        if zlib.crc32(block) != table[b][1]:
            raise ValueError("LZ4 block CRC")
        blocks.append(block)
    return blocks, starts[which[-1] + 1]


class FrameReplay(PrioritizedReplay):
    """The prioritized replay of stacked-frame transitions (same sampling, priorities and
    eviction as :class:`PrioritizedReplay`); ``layout`` is a :class:`FrameLayout`."""

    layout: FrameLayout
    # the plain replay's scripts with its own insert and records (qrl/wire/lua/frames.*.lua)
    INSERT = Lua(
        "frames.insert", "replay.prelude", "frames.insert", constants={"CHUNK_MAX": CHUNK_MAX}
    )
    FETCH, PROPORTIONAL = sampling_scripts("frames", "frames.chunks")

    def record_args(self) -> list[int]:
        return [self.capacity, self.layout.max_chunk()]

    def sample_keys(self) -> list[str]:
        k = self.keys
        return [k.replay_priorities, k.replay_data, k.replay_index, k.replay_frames]

    def insert(self, batch: FrameBatch, priorities: np.ndarray, batch_id: str = "") -> int:  # type: ignore[override]
        """Insert the chunks of ``batch`` with the transitions' priorities; evicts the oldest
        beyond capacity (with the chunks left without transitions). A ``batch_id`` already
        inserted is skipped (returns -1). Returns the number evicted."""
        n, s = len(batch), self.layout.obs_shape[0]
        if len(priorities) != n or batch.refs.shape != (n, 2 * s):
            raise ValueError("refs and priorities must have one row per transition")
        if batch.frames.dtype != np.uint8 or batch.frames.shape[1:] != self.layout.obs_shape[1:]:
            raise ValueError(f"frames must be uint8 of shape (F, {self.layout.obs_shape[1:]})")
        check_chunks(batch.counts, batch.refs, len(batch.frames))
        rec = np.empty(n, self.layout.rec)
        rec["action"], rec["ret"], rec["disc"], rec["refs"] = (
            batch.action,
            batch.ret,
            batch.disc,
            batch.refs,
        )
        blobs, ring, pos, row, frame = [], [], [], 0, 0
        for m, f in batch.counts.tolist():
            blobs.append(encode_chunk(batch.frames[frame : frame + f], rec[row : row + m]))
            ring.append(np.arange(m, dtype="<u4"))
            pos.append(row)
            row, frame = row + m, frame + f
        p = np.clip(np.nan_to_num(priorities, nan=P_HI, posinf=P_HI), P_LO, P_HI)
        args = [
            self.capacity,
            batch_id,
            n,
            " ".join(map(repr, p.tolist())),
            " ".join(map(str, pos)),
            " ".join(str(len(b)) for b in blobs),
            b"".join(blobs),
            np.concatenate(ring).tobytes(),
        ]
        k = self.keys
        keys = [
            k.replay_priorities,
            k.replay_frames,
            k.replay_meta,
            k.replay_batches,
            k.replay_index,
        ]
        return self.evicted(self._insert(keys=keys, args=args))
