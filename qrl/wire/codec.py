"""The wire codec: msgpack inside an LZ4 frame, with numpy arrays as dtype + shape + raw bytes.

Every payload is a msgpack array ``[SCHEMA_VERSION, kind, {field: value}]``
compressed as one LZ4 frame that records its content size. An array travels as a two-element
msgpack list of ``bin``: a header ``[dtype code: u8][ndim: u8][dims: ndim x u32
little-endian]``, then the raw C-order bytes (packed without an extra copy, decoded with
``np.frombuffer``: decoded arrays are read-only views).

Decoding is driven by a :class:`Schema`, which says where arrays are (a field of type
``np.ndarray``, or the values of a ``Field(dict, values=Field(np.ndarray))``); msgpack's only
Python hook counts containers, and arrays are built in the same pass that checks the fields.
Decoding trusts nothing: the frame is decompressed with a size cap (no LZ4 bombs), must be
complete, the top level must carry a known version and the expected kind, the fields must be
exactly the schema's, each of the right type, arrays of an allowed dtype whose shape matches
the byte count. msgpack runs with limits derived from the schema (the longest string, list
and map it admits, binaries up to the payload cap, no extension types, at most
``MAX_CONTAINERS`` lists and maps; small payloads skip the count where it cannot change the
verdict: :attr:`Schema.uncounted_bytes`), so a container bomb is refused at its first oversized
header or as soon as it has built that many containers; a schema's ``max_bytes`` caps its
payloads.
Any failure raises :class:`CodecError` with a message saying what was wrong, and nothing
else: no pickle, no code runs on decode.
"""

import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any

import lz4.frame
import msgpack
import numpy as np

from qrl.wire.schema import (
    _CODE_OF_NAME,
    _DTYPES,
    _HEADER_CACHE_SIZE,
    _HEADERS,
    ALLOWED_DTYPES,
    DEFAULT_MAX_BYTES,
    MAX_CONTAINERS,
    MAX_NDIM,
    CodecError,
    Field,
    Schema,
)

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_MAX_BYTES",
    "SCHEMA_VERSION",
    "CodecError",
    "Field",
    "Schema",
    "decode",
    "decompress",
    "encode",
]

SCHEMA_VERSION = 1

# --------------------------------------------------------------------------- encode


_HEADER_OF: dict[tuple[np.dtype, tuple[int, ...]], bytes] = {}  # (dtype, shape) -> header


def _array_parts(obj: np.ndarray) -> tuple[bytes, memoryview]:
    """An array as (header, raw C-order bytes without a copy)."""
    head = _HEADER_OF.get((obj.dtype, obj.shape))  # only allowed little-endian dtypes are here
    if head is not None:
        view = memoryview(obj)
        if view.c_contiguous:
            return head, view
    code = _CODE_OF_NAME.get(obj.dtype.name)
    if code is None:
        raise CodecError(f"dtype {obj.dtype} is not on the allow-list {sorted(ALLOWED_DTYPES)}")
    if obj.ndim > MAX_NDIM:
        raise CodecError(f"array has {obj.ndim} dimensions, more than {MAX_NDIM}")
    obj = np.asarray(obj, dtype=_DTYPES[code], order="C")  # 0-d stays 0-d
    head = _HEADERS[obj.ndim].pack(code, obj.ndim, *obj.shape)
    if len(_HEADER_OF) >= _HEADER_CACHE_SIZE:
        _HEADER_OF.clear()
    _HEADER_OF[obj.dtype, obj.shape] = head
    return head, memoryview(obj)


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _array_parts(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise CodecError(f"cannot encode a value of type {type(obj).__name__}")


# LZ4 packs at most ~243 bytes into one (64 MiB of zeros: 276,500 bytes), so a payload of
# at most this many bytes holds less than DEFAULT_MAX_BYTES: encode sizes only larger ones
_SIZED = DEFAULT_MAX_BYTES >> 8
_local = threading.local()  # one reusable Packer per thread (a Packer is not thread-safe)


def encode(kind: str, data: Mapping[str, Any]) -> bytes:
    """Encode ``data`` (str keys; values: None, bool, int, float, str, bytes, lists, dicts,
    numpy arrays) as one compressed payload of the given kind; CodecError if no reader
    could take it (over ``DEFAULT_MAX_BYTES``)."""
    try:
        packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(
            default=_default, use_bin_type=True, autoreset=False
        )
    try:
        fields = dict(data)
        for k, v in fields.items():
            if type(v) is np.ndarray:  # the common case, without msgpack's ``default`` detour
                fields[k] = _array_parts(v)
        packer.pack((SCHEMA_VERSION, kind, fields))
        # compress straight from the packer's buffer (the view is released on return, before
        # the reset): no copy of the packed bytes. Defaults: fast mode (level 0), size stored.
        out = lz4.frame.compress(packer.getbuffer())
        # no schema's cap is above DEFAULT_MAX_BYTES: no reader would take a larger message
        if len(out) > _SIZED and (size := len(packer.getbuffer())) > DEFAULT_MAX_BYTES:
            raise CodecError(
                f"a {kind!r} message of {size} bytes is over the {DEFAULT_MAX_BYTES}-byte cap "
                "of every reader"
            )
        return out
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"cannot encode {kind!r}: {e}") from e
    finally:
        packer.reset()


# --------------------------------------------------------------------------- decode


_LZ4_MAGIC = 0x184D2204
_LZ4_HEADER = struct.Struct("<IBxQ")  # magic, FLG, (BD), content size when FLG bit 3 is set
_contexts = threading.local()  # each thread's LZ4 decompression context, at a frame's start


def decompress(payload: bytes, max_bytes: int) -> bytes:
    """One LZ4 frame of at most ``max_bytes`` decompressed, checked whole (what :func:`decode`
    reads; a chunk of :mod:`qrl.wire.chunks`); raises CodecError."""
    if type(payload) is not bytes:
        if not isinstance(payload, (bytearray, memoryview)):
            raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
        payload = bytes(payload)
    # read the declared content size from the frame header (magic, FLG, BD, size u64);
    # lz4 itself verifies the header checksum and enforces the size while inflating
    try:
        magic, flags, size = _LZ4_HEADER.unpack_from(payload)
    except struct.error:
        magic = flags = size = 0
    if magic != _LZ4_MAGIC:
        raise CodecError("not an LZ4 frame (bad magic or header too short)")
    if not flags & 0x08:
        raise CodecError("LZ4 frame does not record its content size")
    if size > max_bytes:
        raise CodecError(f"decompressed payload would be {size} bytes, over the {max_bytes} cap")
    # a thread reuses its context while each frame it reads ends (LZ4F makes it ready for
    # the next frame there); any other outcome leaves it mid-frame, and it is dropped
    try:
        ctx = _contexts.ctx
    except AttributeError:
        ctx = _contexts.ctx = lz4.frame.create_decompression_context()
    try:
        # LZ4F checks the recorded size only at the frame's end, and lz4.frame.decompress
        # grows its buffer until then: a frame lying about its size would inflate in full.
        # Output stops one byte past the recorded size, so such a frame is caught there.
        out, used, end = lz4.frame.decompress_chunk(ctx, payload, size + 1)  # max_length
    except RuntimeError as e:
        del _contexts.ctx
        raise CodecError(f"corrupt or truncated LZ4 frame: {e}") from e
    if end and used == len(payload) and len(out) == size:  # a whole frame, nothing after it
        return out
    if not end:
        del _contexts.ctx
    if len(out) > size:
        raise CodecError(f"LZ4 frame inflates past the {size} bytes its header records")
    if not end:
        raise CodecError("corrupt or truncated LZ4 frame: it ends before its end mark")
    if used != len(payload):
        raise CodecError(f"{len(payload) - used} bytes of trailing data after the LZ4 frame")
    raise CodecError(f"LZ4 frame inflated to {len(out)} bytes, header says {size}")


def _envelope_error(msg: Any, schema: Schema) -> CodecError:
    """Why ``msg`` is not a well-formed envelope of ``schema``'s kind."""
    if type(msg) is not list or len(msg) != 3:
        return CodecError("payload is not a qrl envelope [version, kind, data]")
    version, kind, data = msg
    if version != SCHEMA_VERSION or type(version) is not int:
        return CodecError(f"unknown schema version {version!r} (this qrl speaks {SCHEMA_VERSION})")
    if type(kind) is not str:
        return CodecError("message kind is not a string")
    if type(data) is not dict:
        return CodecError("message data is not a map")
    if kind != schema.kind:
        return CodecError(f"expected a {schema.kind!r} message, got {kind!r}")
    extra = sorted(map(str, data.keys() - schema.fields.keys()))
    return CodecError(f"unexpected fields in {kind!r}: {extra}")


def _container_counter() -> Callable[[Any], Any]:
    """A msgpack hook that lets containers through until there were ``MAX_CONTAINERS``."""
    left = MAX_CONTAINERS

    def hook(obj: Any) -> Any:
        nonlocal left
        left -= 1
        if left < 0:
            raise CodecError(f"more than {MAX_CONTAINERS} lists and maps")
        return obj

    return hook


def decode(payload: bytes, schema: Schema, *, max_bytes: int | None = None) -> dict[str, Any]:
    """Decode a payload and validate it against ``schema`` (at most ``max_bytes``
    decompressed, default the schema's). Raises only :class:`CodecError`."""
    cap, strs, items, bins, uncounted, want, names, plan, check = schema.decoding
    raw = decompress(payload, cap if max_bytes is None else max_bytes)
    try:  # the limits as keywords spelled out: a ** expansion costs
        if len(raw) <= uncounted:
            msg = msgpack.unpackb(
                raw,
                max_str_len=strs,
                max_array_len=items,
                max_map_len=items,
                max_bin_len=bins,
                max_ext_len=0,
            )
        else:
            hook = _container_counter()
            msg = msgpack.unpackb(
                raw,
                max_str_len=strs,
                max_array_len=items,
                max_map_len=items,
                max_bin_len=bins,
                max_ext_len=0,
                list_hook=hook,
                object_hook=hook,
            )
    except Exception as e:  # msgpack raises several types for malformed input
        raise CodecError(f"malformed msgpack: {type(e).__name__}: {e}") from e
    if type(msg) is not list or len(msg) != 3:
        raise _envelope_error(msg, schema)
    version, kind, data = msg
    if not (
        version == SCHEMA_VERSION
        and type(version) is int
        and kind == want
        and type(kind) is str
        and type(data) is dict
        and data.keys() <= names
    ):
        raise _envelope_error(msg, schema)
    out: dict[str, Any] = {}
    try:
        for name, spec, array, optional in plan:
            value = data.get(name)
            if value is None:
                if not optional and name not in data:
                    raise CodecError(f"missing field {name!r} in {kind!r}")
                out[name] = spec.check(name, None)
            elif array:  # arrays, the bulk of every batch, skip one call
                out[name] = spec._array(name, value)
            else:
                out[name] = spec.check(name, value)
        if check is not None:
            check(out)
    except CodecError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise CodecError(f"invalid {kind!r}: {type(e).__name__}: {e}") from e
    return out
