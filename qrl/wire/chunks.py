"""Versioned messages of any size in Redis: the arrays in chunks under a manifest.

A message of a :class:`~qrl.wire.schema.Schema` (a network's weights, a parameter server's
state, a learner's snapshot) is split in two: its arrays (the fields of type ``np.ndarray``
and the values of ``Field(dict, values=Field(np.ndarray))``) are laid end to end as one
stream of bytes, cut into chunks of at most ``chunk_bytes`` (whole elements, the same cut
for the same arrays: :func:`plan`); the rest of the message (its ``head``) goes into the
manifest, with each array's field, name, dtype, wire dtype and shape, and each chunk's
length and SHA1. The manifest is one codec message (``chunks``), under the store's key in a
hash ``{version, blob: manifest, token, count, prev_token, prev_count}``.

- **Small messages keep one round trip.** When the arrays fit in one chunk (every CartPole
  or Atari network: 16 MiB of parameters), the chunk is inlined in the manifest: a reader
  checks the version (one HGET) and fetches one blob when it changed, as before.
- **Writing.** Each chunk is compressed (LZ4) and SET, one at a time, under
  ``KEY:c:TOKEN:I`` (a fresh random ``TOKEN`` per write; the key's hash tag is the store's,
  so a Cluster keeps them in its slot) with an expiry; then one Lua script
  (:data:`PUBLISH`) switches the manifest, refusing a version not newer than the stored
  one (see :mod:`qrl.wire.weights`) and making the chunks last. The version two back loses
  its chunks (the writer deletes them); the one before keeps them, so a reader that began
  it finishes. A writer that dies half-way leaves chunks no manifest names, which expire.
- **Reading.** The manifest is checked (names, dtypes, shapes, lengths, the chunk count
  the arrays make) before anything is allocated; then each chunk is read (at most its
  manifest length + 1 bytes: a huge value costs nothing), checked against its length and
  SHA1, decompressed (bounded) and copied into the destination arrays, one at a time. So
  memory is the arrays plus about one chunk, on both sides, and a reader never loads a mix
  of two versions or a version whose manifest was not switched. A chunk gone because its
  version was superseded twice during the read: read again from the new manifest. Any
  other failure (a key of the wrong type, a truncated, huge or forged chunk or manifest) is
  a :class:`CodecError`: the store logs it, dead-letters the offending blob and returns
  nothing for that version, never raising.
- **The wire dtype.** ``wire="bfloat16"`` or ``"float16"`` sends float32/float64 arrays at
  two bytes an element; a reader casts them back to the dtype the manifest names (the
  module's): half the bytes, within that format's precision.

Every single message and chunk stays under the codec's 64 MiB cap
(:data:`~qrl.wire.schema.DEFAULT_MAX_BYTES`). The same layout goes into a file
(:func:`write_file`, :func:`read_file`): the chunks, then the manifest and its length.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import re
import secrets
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import lz4.frame
import numpy as np
import redis

from qrl.wire.codec import CodecError, Field, Schema, decode, decompress, encode
from qrl.wire.keys import RunKeys
from qrl.wire.schema import ALLOWED_DTYPES, DEFAULT_MAX_BYTES, MAX_NDIM, MAX_STR
from qrl.wire.scripts import Lua
from qrl.wire.stream_scripts import dead_letter

log = logging.getLogger(__name__)

# the manifest switch and a writer's check that the key still holds what it wrote
# (qrl/wire/lua/chunks.*.lua): ChunkedStore.publish, .replace and .kept
PUBLISH, KEPT = Lua("chunks.publish"), Lua("chunks.kept")

CHUNK_BYTES = 16 << 20  # raw bytes a chunk holds (a message this small is one inline chunk)
MAX_CHUNKS = 4096  # chunks one manifest names: 64 GiB of arrays at the default size
MAX_ARRAYS = 65_536  # arrays one message holds
MAX_TOTAL = 64 << 30  # bytes of arrays a manifest may describe (what a reader allocates)
CHUNK_TTL_MS = 600_000  # a written chunk's life until its manifest is switched
WIRE_DTYPES = ("float16", "bfloat16")  # narrower wire dtypes a float array may travel as
_NARROWED = ("float32", "float64")  # the dtypes that may travel narrower
_READ_TRIES = 3  # manifests a read starts from when the chunks of one vanish under it
_TOKEN = re.compile(r"[0-9a-f]{1,32}")
_SHA1 = 20

MAX_VERSION = 2**53 - 1  # stored versions this large or larger are garbage (Lua's doubles)
# how far ahead of a writer's own version another writer's may be for it to count on from
# (a second learner, one restarted from an older checkpoint); further is garbage. One write
# moves a writer's count at most this far: 2**33 of them to reach MAX_VERSION.
MAX_AHEAD = 2**20
_PUBLISH_TRIES = 5

MANIFEST = Schema(
    "chunks",
    {
        "version": Field(int, bounds=(0, MAX_VERSION - 1)),  # the hash's, when stored
        "kind": Field(str),  # the message's schema kind
        "head": Field(dict),  # the message's other fields
        "fields": Field(list, max_len=MAX_ARRAYS),  # per array: its field,
        "names": Field(list, max_len=MAX_ARRAYS),  # its name in the field ("": the field's)
        "dtypes": Field(list, max_len=MAX_ARRAYS),  # its dtype (what a reader gets)
        "wires": Field(list, max_len=MAX_ARRAYS),  # its dtype on the wire
        "ndims": Field(list, max_len=MAX_ARRAYS),
        "dims": Field(list, max_len=MAX_ARRAYS * MAX_NDIM),
        "chunk": Field(int, bounds=(64, DEFAULT_MAX_BYTES // 2)),  # raw bytes a chunk holds
        "token": Field(str, max_len=32),  # names the chunk keys
        "lengths": Field(list, max_len=MAX_CHUNKS),  # each chunk's bytes as stored
        "hashes": Field(list, max_len=MAX_CHUNKS),  # each chunk's SHA1 as stored
        "inline": Field(bytes, optional=True),  # the one chunk, raw (no chunk keys)
    },
)


def ahead(stored: int, own: int) -> bool:
    """Whether ``stored`` is a newer version a writer at ``own`` counts on from, not garbage
    (at most :data:`MAX_AHEAD` ahead, below :data:`MAX_VERSION`)."""
    return own < stored <= ceiling(own)


def ceiling(own: int) -> int:
    """The highest stored version a writer at ``own`` counts on from (above: garbage)."""
    return min(own + MAX_AHEAD, MAX_VERSION - 1)


def chunk_key(key: str, token: str, i: int) -> str:
    """Chunk ``i`` of the write ``token`` of the store at ``key`` (in its hash slot)."""
    return f"{key}:c:{token}:{i}"


def chunked(*names: str) -> tuple[str, ...]:
    """The key patterns of the stores ``names`` (for ``Access.reads`` and ``writes``): each
    store's manifest key and its chunk keys, nothing else."""
    return tuple(p for name in names for p in (name, f"{name}:c:*"))


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Part:
    """One array of a message: its field, its name in that field's dict (``""``: the field
    is the array), its dtype, the dtype it travels as and its shape."""

    field: str
    name: str
    dtype: np.dtype
    wire: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def wire_size(self) -> int:
        return 2 if self.wire == "bfloat16" else np.dtype(self.wire).itemsize


Piece = tuple[int, int, int]  # (part index, first element, end element): one part's share


def plan(parts: list[Part], chunk: int) -> list[list[Piece]]:
    """The chunks ``parts`` make, laid end to end in order and cut at whole elements into
    at most ``chunk`` wire bytes each: the same for writer and reader."""
    chunks: list[list[Piece]] = []
    cur: list[Piece] = []
    room = chunk
    for i, p in enumerate(parts):
        done, size, item = 0, p.size, p.wire_size
        while done < size:
            take = min(size - done, room // item)
            if take == 0:
                chunks.append(cur)
                cur, room = [], chunk
                continue
            cur.append((i, done, done + take))
            done += take
            room -= take * item
    if cur or not chunks:
        chunks.append(cur)
    return chunks


def _holds_arrays(spec: Field) -> bool:
    return spec.type is np.ndarray or (spec.values is not None and spec.values.type is np.ndarray)


def _wire_of(arr: np.ndarray, wire: str | None) -> str:
    return wire if wire is not None and arr.dtype.name in _NARROWED else arr.dtype.name


def split(schema: Schema, msg: Mapping[str, Any], wire: str | None) -> tuple[dict, list, list]:
    """``msg`` as its head (the fields that are no arrays), its parts and their arrays."""
    head: dict[str, Any] = {}
    parts: list[Part] = []
    arrays: list[np.ndarray] = []
    for name, spec in schema.fields.items():
        value = msg.get(name)
        named: Mapping[str, Any]
        if spec.type is np.ndarray and value is not None:
            named = {"": value}
        elif _holds_arrays(spec) and value is not None:
            named = value
        else:
            if name in msg:
                head[name] = value
            continue
        if not named:  # an empty map of arrays: no parts say it is there
            head[name] = {}
        for k, arr in named.items():
            arr = np.asarray(arr)
            if arr.dtype.name not in ALLOWED_DTYPES:
                raise CodecError(f"{name}.{k}: dtype {arr.dtype} is not on the allow-list")
            arrays.append(np.ascontiguousarray(arr).reshape(-1))
            parts.append(Part(name, k, arr.dtype, _wire_of(arr, wire), tuple(arr.shape)))
    if len(parts) > MAX_ARRAYS:
        raise CodecError(f"{len(parts)} arrays, more than {MAX_ARRAYS}")
    return head, parts, arrays


def _to_wire(flat: np.ndarray, part: Part) -> np.ndarray:
    """A piece of an array as its wire dtype (bfloat16: the top half of float32, rounded to
    nearest even); a value the wire dtype cannot hold is a CodecError."""
    if part.wire == part.dtype.name:
        return flat
    if part.wire == "bfloat16":
        bits = flat.astype(np.float32).view(np.uint32)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        check = (out.astype(np.uint32) << 16).view(np.float32)
    else:
        with np.errstate(over="ignore"):  # an overflow is the inf refused below
            out = check = flat.astype(part.wire)
    if not np.isfinite(check).all():
        raise CodecError(f"{part.field}.{part.name}: values {part.wire} cannot hold")
    return out


def _from_wire(raw: memoryview, part: Part, out: np.ndarray) -> None:
    """Wire bytes of a piece into ``out`` (its slice of the destination), cast back."""
    if part.wire == "bfloat16":
        bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        out[...] = bits.view(np.float32)
    else:
        out[...] = np.frombuffer(raw, np.dtype(part.wire).newbyteorder("<"))


def _raw_chunk(pieces: list[Piece], parts: list[Part], arrays: list[np.ndarray]) -> bytes:
    buf = io.BytesIO()
    for i, a, b in pieces:
        buf.write(memoryview(_to_wire(arrays[i][a:b], parts[i])).cast("B"))
    return buf.getvalue()


def _sha1(blob: bytes) -> bytes:
    return hashlib.sha1(blob, usedforsecurity=False).digest()


@dataclass
class Encoded:
    """A message being written: its manifest's fields but the chunks' lengths and hashes,
    filled in as :meth:`chunks` makes them."""

    fields: dict[str, Any]
    pieces: list[list[Piece]]
    parts: list[Part]
    arrays: list[np.ndarray]

    def chunks(self) -> Iterator[bytes]:
        """Each chunk as stored (LZ4), one at a time; none when the one chunk is inline."""
        if self.fields["inline"] is not None:
            return
        self.fields["lengths"], self.fields["hashes"] = [], []
        for pieces in self.pieces:
            blob = lz4.frame.compress(_raw_chunk(pieces, self.parts, self.arrays))
            self.fields["lengths"].append(len(blob))
            self.fields["hashes"].append(_sha1(blob))
            yield blob

    def manifest(self) -> bytes:
        return encode(MANIFEST.kind, self.fields)


def encoding(
    schema: Schema, msg: Mapping[str, Any], wire: str | None = None, chunk: int = CHUNK_BYTES
) -> Encoded:
    """``msg`` (a message of ``schema``) ready to write: :meth:`Encoded.chunks`, then
    :meth:`Encoded.manifest`."""
    if wire is not None and wire not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {wire!r} is none of {WIRE_DTYPES}")
    head, parts, arrays = split(schema, msg, wire)
    pieces = plan(parts, chunk)
    if len(pieces) > MAX_CHUNKS:
        raise CodecError(f"{len(pieces)} chunks of {chunk} bytes, more than {MAX_CHUNKS}")
    inline = _raw_chunk(pieces[0], parts, arrays) if len(pieces) == 1 else None
    fields = {
        "version": 0,
        "kind": schema.kind,
        "head": head,
        "fields": [p.field for p in parts],
        "names": [p.name for p in parts],
        "dtypes": [p.dtype.name for p in parts],
        "wires": [p.wire for p in parts],
        "ndims": [len(p.shape) for p in parts],
        "dims": [d for p in parts for d in p.shape],
        "chunk": chunk,
        "token": secrets.token_hex(8),
        "lengths": [],
        "hashes": [],
        "inline": inline,
    }
    return Encoded(fields, pieces, parts, arrays)


def encode_whole(schema: Schema, msg: Mapping[str, Any], version: int = 0) -> bytes:
    """``msg`` as one manifest of ``version`` with its arrays inline (CodecError if they
    need chunks): what a store holds for a small message (tests forge stored values so)."""
    enc = encoding(schema, msg, chunk=DEFAULT_MAX_BYTES // 2)
    if enc.fields["inline"] is None:
        raise CodecError(f"a {schema.kind!r} message too large for one manifest")
    enc.fields["version"] = version
    return enc.manifest()


def _str_list(m: dict, name: str, n: int) -> list[str]:
    values = m[name]
    if len(values) != n or not all(type(v) is str and len(v) <= MAX_STR for v in values):
        raise CodecError(f"manifest {name}: not {n} strings")
    return values


def _int_list(m: dict, name: str, n: int, lo: int, hi: int) -> list[int]:
    values = m[name]
    if len(values) != n or not all(type(v) is int and lo <= v <= hi for v in values):
        raise CodecError(f"manifest {name}: not {n} whole numbers in {lo}..{hi}")
    return values


@dataclass
class Manifest:
    """A stored manifest, checked: its head, parts, chunk plan, lengths and hashes."""

    version: int
    head: dict[str, Any]
    parts: list[Part]
    pieces: list[list[Piece]]
    token: str
    lengths: list[int]
    hashes: list[bytes]
    inline: bytes | None

    @classmethod
    def of(cls, blob: bytes, schema: Schema) -> Manifest:
        """The manifest in ``blob`` for a message of ``schema``; CodecError unless it is one
        and describes arrays that ``schema`` has, of at most :data:`MAX_TOTAL` bytes."""
        m = decode(blob, MANIFEST)
        if m["kind"] != schema.kind:
            raise CodecError(f"manifest of a {m['kind']!r} message, expected {schema.kind!r}")
        for name, value in m["head"].items():  # an array field there: None or no arrays only
            spec = schema.fields.get(name)
            if spec is not None and _holds_arrays(spec) and value not in (None, {}):
                raise CodecError(f"manifest head holds array field {name!r}")
        n = len(m["fields"])
        fields, names = _str_list(m, "fields", n), _str_list(m, "names", n)
        dtypes, wires = _str_list(m, "dtypes", n), _str_list(m, "wires", n)
        ndims = _int_list(m, "ndims", n, 0, MAX_NDIM)
        dims = _int_list(m, "dims", sum(ndims), 0, 2**32 - 1)
        parts, at, total = [], 0, 0
        for f, k, dt, w, nd in zip(fields, names, dtypes, wires, ndims, strict=True):
            spec = schema.fields.get(f)
            if spec is None or not _holds_arrays(spec):
                raise CodecError(f"manifest names array field {f!r}, not one of {schema.kind}")
            if (spec.type is np.ndarray) != (k == ""):
                raise CodecError(f"manifest names {f}.{k}: a field is an array or named ones")
            if dt not in ALLOWED_DTYPES or not (w == dt or (dt in _NARROWED and w in WIRE_DTYPES)):
                raise CodecError(f"{f}.{k}: dtype {dt} on the wire as {w}")
            part = Part(f, k, np.dtype(dt).newbyteorder("<"), w, tuple(dims[at : at + nd]))
            at += nd
            total += part.size * part.dtype.itemsize
            if total > MAX_TOTAL:
                raise CodecError(f"manifest describes over {MAX_TOTAL} bytes of arrays")
            parts.append(part)
        if len(set(zip(fields, names, strict=True))) != n:
            raise CodecError("manifest names an array twice")
        pieces = plan(parts, m["chunk"])
        if len(pieces) > MAX_CHUNKS:
            raise CodecError(f"manifest's arrays make {len(pieces)} chunks")
        if not _TOKEN.fullmatch(m["token"]):
            raise CodecError("manifest token is not hex")
        inline = m["inline"]
        count = 0 if inline is not None else len(pieces)
        lengths = _int_list(m, "lengths", count, 1, DEFAULT_MAX_BYTES)
        hashes = m["hashes"]
        if len(hashes) != count or not all(type(h) is bytes and len(h) == _SHA1 for h in hashes):
            raise CodecError(f"manifest hashes: not {count} SHA1s")
        if inline is not None and (len(pieces) != 1 or len(inline) != _raw_size(pieces[0], parts)):
            raise CodecError("manifest's inline chunk does not hold its arrays")
        return cls(m["version"], m["head"], parts, pieces, m["token"], lengths, hashes, inline)

    def assemble(self, schema: Schema, chunk: Callable[[int, int], bytes | None]) -> dict:
        """The message: the arrays filled chunk by chunk (``chunk(i, length)``: stored chunk
        ``i``, at most ``length`` + 1 bytes of it, ``None`` if it is gone: raises
        :class:`Gone`), then the whole checked against ``schema``; CodecError if not."""
        out = [np.empty(p.shape, p.dtype) for p in self.parts]
        flats = [a.reshape(-1) for a in out]
        for i, pieces in enumerate(self.pieces):
            if self.inline is not None:
                raw = self.inline
            else:
                blob = chunk(i, self.lengths[i])
                if blob is None:
                    raise Gone(i)
                if len(blob) != self.lengths[i] or _sha1(blob) != self.hashes[i]:
                    raise CodecError(f"chunk {i}: {len(blob)} bytes not the manifest's")
                raw = decompress(blob, _raw_size(pieces, self.parts))
            view, at = memoryview(raw), 0
            if len(raw) != _raw_size(pieces, self.parts):
                raise CodecError(f"chunk {i}: {len(raw)} bytes, not its arrays'")
            for j, a, b in pieces:
                n = (b - a) * self.parts[j].wire_size
                _from_wire(view[at : at + n], self.parts[j], flats[j][a:b])
                at += n
        msg = dict(self.head)
        for p, arr in zip(self.parts, out, strict=True):
            if p.name:
                msg.setdefault(p.field, {})[p.name] = arr
            else:
                msg[p.field] = arr
        return validate(schema, msg)


def _raw_size(pieces: list[Piece], parts: list[Part]) -> int:
    return sum((b - a) * parts[i].wire_size for i, a, b in pieces)


class Gone(Exception):
    """A chunk of the manifest being read is gone: the version was superseded twice."""


def validate(schema: Schema, msg: dict[str, Any]) -> dict[str, Any]:
    """``msg`` (built from a manifest) checked against ``schema`` as :func:`decode` checks
    a message: exactly its fields, each of its type, arrays of its dtypes, dimensions,
    finiteness and bounds, then its cross-field check; CodecError if not."""
    extra = sorted(set(msg) - set(schema.fields))
    if extra:
        raise CodecError(f"unexpected fields in {schema.kind!r}: {extra}")
    out: dict[str, Any] = {}
    try:
        for name, spec in schema.fields.items():
            value = msg.get(name)
            if value is None:
                if not spec.optional and name not in msg:
                    raise CodecError(f"missing field {name!r} in {schema.kind!r}")
                out[name] = spec.check(name, None)
            elif spec.type is np.ndarray:
                out[name] = spec.check_array(name, value)
            elif spec.values is not None and spec.values.type is np.ndarray:
                if len(value) > spec.longest:
                    raise CodecError(f"field {name!r} holds {len(value)} items")
                out[name] = {k: spec.values.check_array(f"{name}.{k}", v) for k, v in value.items()}
            else:
                out[name] = spec.check(name, value)
        if schema.check is not None:
            schema.check(out)
    except CodecError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise CodecError(f"invalid {schema.kind!r}: {type(e).__name__}: {e}") from e
    return out


# --------------------------------------------------------------------------- Redis


class ChunkedStore:
    """A versioned message of ``schema`` under ``key``: :meth:`publish` (versions only go
    up) or :meth:`replace` it, :meth:`version`, :meth:`read` and :meth:`kept`. ``wire``: the
    dtype float arrays travel as (:data:`WIRE_DTYPES`; ``None``: their own)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        key: str,
        schema: Schema,
        *,
        wire: str | None = None,
        chunk: int = CHUNK_BYTES,
    ) -> None:
        self.client, self.keys, self.key, self.schema = client, keys, key, schema
        self.wire, self.chunk = wire, chunk
        self._publish, self._kept = PUBLISH.on(client), KEPT.on(client)
        # its last write, for kept(): version, manifest SHA1 and length, chunk keys, their
        # lengths and SHA1s; the chunk kept() hashes next
        self._mine: tuple[int, str, int, list[str], list[int], list[str]] | None = None
        self._turn = 0
        self._checked = 0.0  # monotonic time of the last publish or kept() check
        self._rejected: int | None = None  # version whose message failed, not read again
        self._overtaken = self._wrongtype = False  # warned about (once)

    @property
    def source(self) -> str:
        """The store's key within the run's (its dead letters' source)."""
        return self.key.removeprefix(self.keys.prefix)

    # -- writing
    def publish(self, msg: Mapping[str, Any], version: int) -> int:
        """Store ``msg`` as ``version``, atomically; returns the version stored, which the
        caller carries on from. Versions only go up: if the key holds ``version`` or a newer
        one, another writer got there first, and ``msg`` goes above it (version + 1), with a
        warning the first time. A stored version that is not a whole number from 0 to
        :data:`MAX_AHEAD` past ``version`` (below :data:`MAX_VERSION`), or a key that is not
        a hash, is garbage and overwritten."""
        version = int(version)
        enc = encoding(self.schema, msg, self.wire, self.chunk)
        names = self._put(enc)
        for _ in range(_PUBLISH_TRIES):
            enc.fields["version"] = version
            manifest = enc.manifest()
            args = [version, manifest, ceiling(version), enc.fields["token"]]
            done, stored, *gone = self._publish(keys=[self.key, *names], args=args)
            if int(done) == 1:
                self._drop(*gone)
                self._remember(version, manifest, names, enc)
                return version
            if int(done) == -1:  # a chunk expired before the switch: written again
                names = self._put(enc)
                continue
            if not self._overtaken:
                self._overtaken = True
                log.warning(
                    "%s holds version %d, not older than this writer's %d: another writer? "
                    "publishing above it (version %d) and carrying on from there",
                    self.key,
                    int(stored),
                    version,
                    int(stored) + 1,
                )
            version = int(stored) + 1
        if names:
            self.client.delete(*names)
        log.warning("%s: another writer keeps getting ahead; not published this time", self.key)
        return version

    def replace(self, msg: Mapping[str, Any]) -> int:
        """Store ``msg`` above whatever version is stored (a store with one writer whose
        latest message is the one to keep: a snapshot, a saved state); the version stored."""
        return self.publish(msg, self.version() + 1)

    def _put(self, enc: Encoded) -> list[str]:
        """Write ``enc``'s chunks, one at a time, each to expire unless switched to."""
        names = []
        for i, blob in enumerate(enc.chunks()):
            names.append(chunk_key(self.key, enc.fields["token"], i))
            self.client.set(names[-1], blob, px=CHUNK_TTL_MS)
        return names

    def _remember(self, version: int, manifest: bytes, names: list[str], enc: Encoded) -> None:
        sha = hashlib.sha1(manifest, usedforsecurity=False).hexdigest()
        hashes = [h.hex() for h in enc.fields["hashes"]]
        self._mine = (version, sha, len(manifest), names, list(enc.fields["lengths"]), hashes)
        self._checked = time.monotonic()

    def _drop(self, token: Any, count: Any) -> None:
        """Delete the chunks of the version two back (what the switch replied), if they are
        the chunks a write makes (a writer may have put anything in the hash)."""
        token = token.decode() if isinstance(token, bytes) else str(token)
        try:
            n = int(count)
        except ValueError:
            return
        if _TOKEN.fullmatch(token) and 0 < n <= MAX_CHUNKS:
            self.client.delete(*(chunk_key(self.key, token, i) for i in range(n)))

    def kept(self, every_s: float = 1.0) -> bool:
        """Whether the key still holds the version, manifest and chunks this store last
        wrote (True if it wrote none); checked in Redis at most once every ``every_s``
        seconds after the last write or check, True in between (one chunk's content a
        check, in turn; every chunk's length). False means another writer's took its place:
        readers that rejected it wait for a new version."""
        now = time.monotonic()
        if self._mine is None or now - self._checked < every_s:
            return True
        self._checked = now
        version, sha, length, names, lengths, hashes = self._mine
        j = self._turn % len(names) + 1 if names else 0
        self._turn += 1
        args = [version, sha, length, j, hashes[j - 1] if j else "", *lengths]
        return bool(self._kept(keys=[self.key, *names], args=args))

    # -- reading
    def version(self) -> int:
        """The stored version, -1 if nothing (or garbage) was stored (one HGET)."""
        v = self._read(lambda: self.client.hget(self.key, "version"))
        try:
            v = int(v) if v is not None else -1
        except ValueError:
            return -1
        return v if 0 <= v < MAX_VERSION else -1

    def _read(self, command: Callable[[], Any]) -> Any:
        """``command()``, or None if the key is not a hash (garbage: logged once)."""
        try:
            return command()
        except redis.ResponseError as e:
            if not str(e).startswith("WRONGTYPE"):
                raise
            if not self._wrongtype:
                self._wrongtype = True
                log.warning("%s is not a hash (written by something else): ignored", self.key)
            return None

    def read(
        self, newer_than: int = -1, accept: Callable[[Manifest], None] | None = None
    ) -> tuple[int, dict[str, Any]] | None:
        """The stored version and message if the version is not ``newer_than``, else None.
        ``accept(manifest)`` may raise CodecError to refuse a version before its chunks are
        read (arrays that do not fit the reader). A version that fails (malformed, forged,
        refused) is logged and dead-lettered once and None returned: the reader keeps what
        it has."""
        if self.version() in (-1, newer_than):
            return None
        gone = None  # the version whose chunk was gone
        for _ in range(_READ_TRIES):
            pair = self._read(lambda: self.client.hmget(self.key, ["version", "blob"]))
            version, blob = pair or (None, None)
            try:
                version = int(version) if version is not None else None
            except ValueError:
                version = None
            if blob is None or version is None or version in (self._rejected, newer_than):
                return None
            if version == gone:  # not superseded: its manifest names a chunk never there
                self._reject(version, "a chunk of the stored version is missing", blob)
                return None
            try:
                manifest = Manifest.of(blob, self.schema)
                if manifest.version != version:
                    raise CodecError(f"manifest of version {manifest.version}, key's {version}")
                if accept is not None:
                    accept(manifest)
                return version, manifest.assemble(self.schema, self._chunk_reader(manifest))
            except Gone:
                gone = version  # superseded twice while read? read the new manifest
                continue
            except _Bad as e:
                self._reject(version, str(e.error), e.blob)
            except CodecError as e:
                self._reject(version, str(e), blob)
            return None
        return None

    def _chunk_reader(self, manifest: Manifest) -> Callable[[int, int], bytes | None]:
        def chunk(i: int, length: int) -> bytes | None:
            name = chunk_key(self.key, manifest.token, i)
            try:
                blob = self.client.getrange(name, 0, length)  # at most length + 1 bytes
            except redis.ResponseError as e:
                raise CodecError(f"chunk {name}: {e}") from e
            if not blob:
                if self.client.exists(name):  # an empty string: a writer's
                    raise CodecError(f"chunk {name} is empty")
                return None
            if len(blob) != length or _sha1(blob) != manifest.hashes[i]:
                raise _Bad(CodecError(f"chunk {name} is not the manifest's"), blob)
            return blob

        return chunk

    def _reject(self, version: int, why: str, blob: bytes | None) -> None:
        log.warning("rejected %s version %d: %s", self.key, version, why)
        self._rejected = version
        dead_letter(self.client, self.keys, self.source, why, blob)


class _Bad(Exception):
    """A chunk that is not the manifest's: dead-lettered itself."""

    def __init__(self, error: CodecError, blob: bytes) -> None:
        super().__init__(str(error))
        self.error, self.blob = error, blob


# --------------------------------------------------------------------------- files

_TAIL = struct.Struct("<Q")  # a file ends with its manifest's length


def write_file(f: BinaryIO, schema: Schema, msg: Mapping[str, Any]) -> None:
    """``msg`` into ``f``, a chunk at a time: the chunks, the manifest, its length."""
    enc = encoding(schema, msg)
    for blob in enc.chunks():
        f.write(blob)
    manifest = enc.manifest()
    f.write(manifest)
    f.write(_TAIL.pack(len(manifest)))


def read_file(path: Path, schema: Schema) -> dict[str, Any]:
    """The message :func:`write_file` left in ``path``, a chunk at a time, checked;
    CodecError if it is not one (FileNotFoundError if there is no file)."""
    with open(path, "rb") as f:
        end = f.seek(0, io.SEEK_END)
        if end < _TAIL.size:
            raise CodecError("file too short for a manifest")
        f.seek(end - _TAIL.size)
        (length,) = _TAIL.unpack(f.read(_TAIL.size))
        if length > min(DEFAULT_MAX_BYTES, end - _TAIL.size):
            raise CodecError(f"manifest of {length} bytes")
        f.seek(end - _TAIL.size - length)
        manifest = Manifest.of(f.read(length), schema)
        starts = np.cumsum([0, *manifest.lengths]).tolist()
        if starts[-1] != end - _TAIL.size - length:
            raise CodecError("file's chunks are not the manifest's")

        def chunk(i: int, n: int) -> bytes:
            f.seek(starts[i])
            return f.read(n)

        return manifest.assemble(schema, chunk)
