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
  previous one, so a block costs far less than its frames compressed one by one).
  ``replay:index`` is a ring of ``capacity`` u32: slot ``id % capacity`` holds the distance
  from transition ``id`` to the first transition of its chunk.
* Priorities and FIFO eviction are the plain replay's (``replay:prio``, consecutive ids).
  Evicting transitions ``[lo, new_lo)`` deletes the chunks that start before the chunk of
  ``new_lo``: exactly those with no transition left.
* Sampling is the plain replay's scripts with another ``records`` function: each sampled
  id comes with its chunk (one Lua call). The sampler decodes and checks every chunk
  (sizes, a CRC-32, references, LZ4 blocks decompressed to their exact expected size); a
  transition whose chunk is missing or corrupt is dropped from the batch and removed from
  the replay (dead-lettered and counted, as :meth:`PrioritizedReplay.reject` does).
"""

from __future__ import annotations

import itertools
import logging
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import lz4.block
import numpy as np

from qrl.algos.apex_family.messages import check_chunks
from qrl.replay.scripts import FRAME_CHUNKS, FRAME_INSERT, PRELUDE
from qrl.replay.store import P_HI, P_LO, Columns, PrioritizedReplay, RecordLayout, Rows

log = logging.getLogger(__name__)

FRAMES_PER_BLOCK = 8
# transitions per chunk at most: a sampled transition fetches its whole chunk, and the
# references and counts are u16
CHUNK_MAX = 256
_HEAD = struct.Struct("<BBHHI")  # version, frames per block, transitions, frames, CRC-32
_VERSION = 1


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


def encode_chunk(frames: np.ndarray, records: np.ndarray) -> bytes:
    """One chunk as stored: header (with the CRC-32 of the rest), records, LZ4 block sizes
    (u32), LZ4 blocks."""
    g = FRAMES_PER_BLOCK
    blocks = [
        lz4.block.compress(frames[i : i + g].tobytes(), store_size=False)
        for i in range(0, len(frames), g)
    ]
    sizes = np.asarray([len(b) for b in blocks], "<u4")
    body = b"".join([records.tobytes(), sizes.tobytes(), *blocks])
    return _HEAD.pack(_VERSION, g, len(records), len(frames), zlib.crc32(body)) + body


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

    def unpack(self, records: list[Any]) -> np.ndarray:
        """Decode ``[rel, chunk]`` pairs (from the sampling scripts) into a batch with an
        ``ok`` flag per row (zeros where it is not)."""
        out = np.zeros(len(records), self.dtype)
        batch, ok = self.decode(records)
        out[ok] = batch
        return out

    def _gather(
        self, records: list[Any]
    ) -> tuple[list[int], list[np.ndarray], np.ndarray, np.ndarray]:
        """Per transition that passes every check: ``(its row, the frames of the LZ4 blocks
        its references fall in, its 2 x stack frame indices into them, its record)``. The
        frames are a view of its one block, or its few blocks joined: joining every
        transition's blocks into one array first copied (and page-faulted) the whole batch's
        decompressed frames once more."""
        rows, recs, frames, idx = [], [], [], []
        for i, item in enumerate(records):
            try:
                r, g, blocks = self._transition(item)
            except (ValueError, TypeError, IndexError, struct.error, lz4.block.LZ4BlockError):
                continue
            first, at = {}, 0
            for b, raw in blocks.items():
                first[b], at = at, at + len(raw) // self.frame_bytes
            raw = b"".join(blocks.values()) if len(blocks) > 1 else next(iter(blocks.values()))
            frames.append(np.frombuffer(raw, np.uint8).reshape(-1, *self.obs_shape[1:]))
            idx.append([first[j // g] + j % g for j in r["refs"].tolist()])
            rows.append(i)
            recs.append(r)
        return rows, frames, np.asarray(idx, np.intp), np.asarray(recs, self.rec)

    def max_chunk(self) -> int:
        """The most bytes a chunk can take: ``CHUNK_MAX`` records and as many distinct
        frames as they can reference, in LZ4 blocks that did not compress at all."""
        frames = 2 * self.obs_shape[0] * CHUNK_MAX
        raw = FRAMES_PER_BLOCK * self.frame_bytes
        blocks = -(-frames // FRAMES_PER_BLOCK)
        return _HEAD.size + CHUNK_MAX * self.rec.itemsize + blocks * (4 + raw + raw // 255 + 16)

    def decode(self, records: list[Any], out: Columns | None = None) -> tuple[Rows, np.ndarray]:
        """The transitions whose chunk passed every check, and which did: their stacks
        gathered from the decompressed frames straight into ``out`` (a ring slot's columns)
        if given, else into a new batch of records."""
        rows, frames, idx, rec = self._gather(records)
        ok, k, s = np.zeros(len(records), bool), len(rows), self.obs_shape[0]
        ok[rows] = True
        batch = None
        if out is None:
            batch = np.zeros(k, self.dtype)
            batch["ok"] = True
            out = {n: batch[n] for n in self.dtype.names or ()}
        obs, next_obs = out["obs"], out["next_obs"]
        for t, (f, ix) in enumerate(zip(frames, idx, strict=True)):
            np.take(f, ix[:s], axis=0, out=obs[t])
            np.take(f, ix[s:], axis=0, out=next_obs[t])
        if k:
            for name in ("action", "ret", "disc"):
                out[name][:k] = rec[name]
        if batch is not None:
            return batch, ok
        return {n: out[n][:k] for n in ("obs", "action", "ret", "disc", "next_obs")}, ok

    def parse(self, blob: Any) -> tuple[np.ndarray, int, int, list[bytes]]:
        """A stored chunk's records, frame count, frames per block and LZ4 blocks; raises
        ``ValueError`` unless its header and sizes are consistent and its CRC matches."""
        if not isinstance(blob, bytes) or len(blob) < _HEAD.size:
            raise ValueError("chunk missing")
        version, g, n, f, crc = _HEAD.unpack_from(blob)
        n_blocks = -(-f // g) if g else 0
        at = _HEAD.size + n * self.rec.itemsize
        if version != _VERSION or n < 1 or n_blocks < 1 or len(blob) < at + 4 * n_blocks:
            raise ValueError("chunk header")
        sizes = struct.unpack_from(f"<{n_blocks}I", blob, at)
        ends = list(itertools.accumulate(sizes, initial=at + 4 * n_blocks))
        if ends[-1] != len(blob) or zlib.crc32(memoryview(blob)[_HEAD.size :]) != crc:
            raise ValueError("chunk size or CRC")
        blocks = [blob[a:b] for a, b in itertools.pairwise(ends)]
        return np.frombuffer(blob, self.rec, n, _HEAD.size), f, g, blocks

    def _block(self, blocks: list[bytes], b: int, f: int, g: int) -> bytes:
        """Frames ``b*g ..`` of a chunk, decompressed to exactly their expected size."""
        want = (min(f, (b + 1) * g) - b * g) * self.frame_bytes
        raw = lz4.block.decompress(blocks[b], uncompressed_size=want)
        if len(raw) != want:
            raise ValueError("LZ4 block size")
        return raw

    def chunk_frames(self, blob: bytes) -> np.ndarray:
        """Every frame of a stored chunk, in order."""
        _, f, g, blocks = self.parse(blob)
        raw = b"".join(self._block(blocks, b, f, g) for b in range(len(blocks)))
        return np.frombuffer(raw, np.uint8).reshape(-1, *self.obs_shape[1:])

    def _transition(self, item: Any) -> tuple[np.void, int, dict[int, bytes]]:
        """A sampled transition's record, its chunk's frames per block and the blocks its
        frames are in (decompressed); raises unless every check passes."""
        rel_b, blob = item
        recs, f, g, blocks = self.parse(blob)
        (rel,) = struct.unpack("<I", rel_b)
        r = recs[rel]  # IndexError past the chunk's transitions
        refs = r["refs"].tolist()
        ok = 0 <= r["action"] < self.n_actions and np.isfinite(r["ret"]) and 0 <= r["disc"] <= 1
        if not ok or abs(r["ret"]) > 1e6 or max(refs) >= f:
            raise ValueError("chunk record out of bounds")
        return r, g, {b: self._block(blocks, b, f, g) for b in sorted({j // g for j in refs})}


class FrameReplay(PrioritizedReplay):
    """The prioritized replay of stacked-frame transitions (same sampling, priorities and
    eviction as :class:`PrioritizedReplay`); ``layout`` is a :class:`FrameLayout`."""

    layout: FrameLayout

    def __init__(
        self, client: Any, keys: Any, layout: FrameLayout, capacity: int, **kw: Any
    ) -> None:
        super().__init__(client, keys, layout, capacity, **kw)
        self._insert = client.register_script(
            f"{PRELUDE}local CHUNK_MAX = {CHUNK_MAX}{FRAME_INSERT}"
        )

    def records_lua(self) -> str:
        return FRAME_CHUNKS % (self.capacity, self.layout.max_chunk())

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
