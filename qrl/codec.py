"""The wire codec: msgpack inside an LZ4 frame, with numpy arrays as dtype + shape + raw bytes.

Every payload is a msgpack map ``{"v": SCHEMA_VERSION, "k": kind, "d": {field: value}}``
compressed as one LZ4 frame. An array travels as a msgpack extension (code 1) whose data is
``[dtype code: u8][ndim: u8][dims: ndim x u32 little-endian][raw C-order bytes]``.

Decoding trusts nothing: the frame is decompressed with a size cap (no LZ4 bombs), must be
complete, the top level must carry a known version and the expected kind, the fields must be
exactly the schema's, each of the right type, arrays of an allowed dtype whose shape matches
the byte count. Any failure raises :class:`CodecError` with a message saying what was wrong,
and nothing else: no pickle, no code runs on decode.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import lz4.frame
import msgpack
import numpy as np

SCHEMA_VERSION = 1
DEFAULT_MAX_BYTES = 256 * 1024 * 1024  # decompressed size cap
MAX_NDIM = 8
_EXT_ARRAY = 1

# dtype allow-list: code <-> little-endian numpy dtype
_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name).newbyteorder("<")
    for name in (
        "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
        "float16", "float32", "float64",
    )
)  # fmt: skip
_CODE_OF_NAME = {dt.name: i for i, dt in enumerate(_DTYPES)}
ALLOWED_DTYPES: frozenset[str] = frozenset(dt.name for dt in _DTYPES)


class CodecError(ValueError):
    """A payload could not be encoded or failed validation on decode; the message says why."""


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class Field:
    """One expected field of a message.

    ``type`` is one of ``int, float, str, bytes, bool, list, dict, np.ndarray``. For arrays,
    ``dtypes`` restricts the dtype, ``ndim`` the number of dimensions, and ``finite`` rejects
    NaN and infinity. ``optional`` fields may be absent (decoded as ``None``).
    """

    type: type
    dtypes: tuple[str, ...] | None = None
    ndim: int | None = None
    finite: bool = False
    optional: bool = False


@dataclass(frozen=True)
class Schema:
    """A message kind and its fields. ``check`` may add cross-field validation; it raises
    :class:`CodecError` (or ``ValueError``) on a bad message."""

    kind: str
    fields: Mapping[str, Field]
    check: Callable[[dict[str, Any]], None] | None = field(default=None, compare=False)


# --------------------------------------------------------------------------- encode


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        code = _CODE_OF_NAME.get(obj.dtype.name)
        if code is None:
            raise CodecError(f"dtype {obj.dtype} is not on the allow-list {sorted(ALLOWED_DTYPES)}")
        if obj.ndim > MAX_NDIM:
            raise CodecError(f"array has {obj.ndim} dimensions, more than {MAX_NDIM}")
        arr = np.asarray(obj, dtype=_DTYPES[code], order="C")  # keeps 0-d arrays 0-d
        header = struct.pack(f"<BB{arr.ndim}I", code, arr.ndim, *arr.shape)
        return msgpack.ExtType(_EXT_ARRAY, header + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise CodecError(f"cannot encode a value of type {type(obj).__name__}")


def encode(kind: str, data: Mapping[str, Any]) -> bytes:
    """Encode ``data`` (str keys; values: None, bool, int, float, str, bytes, lists, dicts,
    numpy arrays) as one compressed payload of the given kind."""
    try:
        packed = msgpack.packb(
            {"v": SCHEMA_VERSION, "k": kind, "d": dict(data)},
            default=_default,
            use_bin_type=True,
        )
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"cannot encode {kind!r}: {e}") from e
    return lz4.frame.compress(packed, compression_level=0, store_size=True)


# --------------------------------------------------------------------------- decode


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_ARRAY:
        raise CodecError(f"unknown msgpack extension type {code}")
    if len(data) < 2:
        raise CodecError("array header truncated")
    dcode, ndim = data[0], data[1]
    if dcode >= len(_DTYPES):
        raise CodecError(f"array dtype code {dcode} is not on the allow-list")
    if ndim > MAX_NDIM:
        raise CodecError(f"array has {ndim} dimensions, more than {MAX_NDIM}")
    start = 2 + 4 * ndim
    if len(data) < start:
        raise CodecError("array shape truncated")
    shape = struct.unpack_from(f"<{ndim}I", data, 2)
    dt = _DTYPES[dcode]
    expected = math.prod(shape) * dt.itemsize
    if expected != len(data) - start:
        raise CodecError(
            f"array of shape {shape} and dtype {dt.name} needs {expected} bytes, "
            f"payload has {len(data) - start}"
        )
    return np.frombuffer(data, dtype=dt, offset=start).reshape(shape)


def _decompress(payload: bytes, max_bytes: int) -> bytes:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    d = lz4.frame.LZ4FrameDecompressor()
    try:
        out = d.decompress(payload, max_length=max_bytes + 1)
    except RuntimeError as e:
        raise CodecError(f"corrupt LZ4 frame: {e}") from e
    if len(out) > max_bytes:
        raise CodecError(f"decompressed payload exceeds the {max_bytes}-byte cap")
    if not d.eof:
        raise CodecError("truncated LZ4 frame")
    if d.unused_data:
        raise CodecError(f"{len(d.unused_data)} bytes of trailing data after the LZ4 frame")
    return out


_TYPE_NAMES = {np.ndarray: "array", bytes: "bytes", str: "str", int: "int", float: "float"}


_PLAIN = (type(None), bool, int, float, str, bytes, np.ndarray)


def _check_plain(name: str, value: Any, depth: int = 0) -> None:
    """Reject anything but plain values inside lists and maps (e.g. msgpack timestamps)."""
    if depth > 32:
        raise CodecError(f"field {name!r} is nested too deeply")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CodecError(f"field {name!r} has a non-string key {k!r}")
            _check_plain(f"{name}.{k}", v, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(f"{name}[{i}]", v, depth + 1)
    elif not isinstance(value, _PLAIN):
        raise CodecError(f"field {name!r} holds a {type(value).__name__}")


def _check_field(name: str, value: Any, spec: Field) -> Any:
    if value is None:
        if spec.optional:
            return None
        raise CodecError(f"field {name!r} is null")
    t = spec.type
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, t) and not (t is int and isinstance(value, bool))
    if not ok:
        want = _TYPE_NAMES.get(t, t.__name__)
        raise CodecError(f"field {name!r} must be {want}, got {type(value).__name__}")
    if t is float and spec.finite and not math.isfinite(value):
        raise CodecError(f"field {name!r} is not finite ({value})")
    if t in (dict, list):
        _check_plain(name, value)
    if t is np.ndarray:
        if spec.dtypes is not None and value.dtype.name not in spec.dtypes:
            raise CodecError(f"field {name!r} has dtype {value.dtype.name}, expected {spec.dtypes}")
        if spec.ndim is not None and value.ndim != spec.ndim:
            raise CodecError(f"field {name!r} has {value.ndim} dimensions, expected {spec.ndim}")
        if spec.finite and value.dtype.kind == "f" and not np.isfinite(value).all():
            raise CodecError(f"field {name!r} contains NaN or infinity")
    return value


def decode_any(payload: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, dict[str, Any]]:
    """Decode and check the envelope (frame, size cap, version, kind, arrays) but not the
    fields; returns ``(kind, data)``. Use :func:`decode` with a schema to validate fields."""
    raw = _decompress(payload, max_bytes)
    try:
        msg = msgpack.unpackb(raw, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except CodecError:
        raise
    except Exception as e:  # msgpack raises several types for malformed input
        raise CodecError(f"malformed msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(msg, dict) or set(msg) != {"v", "k", "d"}:
        raise CodecError("payload is not a qrl envelope {v, k, d}")
    if msg["v"] != SCHEMA_VERSION:
        raise CodecError(f"unknown schema version {msg['v']!r} (this qrl speaks {SCHEMA_VERSION})")
    kind, data = msg["k"], msg["d"]
    if not isinstance(kind, str):
        raise CodecError("message kind is not a string")
    if not isinstance(data, dict):
        raise CodecError("message data is not a map")
    return kind, data


def decode(payload: bytes, schema: Schema, *, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """Decode a payload and validate it against ``schema``. Raises only :class:`CodecError`."""
    kind, data = decode_any(payload, max_bytes=max_bytes)
    if kind != schema.kind:
        raise CodecError(f"expected a {schema.kind!r} message, got {kind!r}")
    extra = set(data) - set(schema.fields)
    if extra:
        raise CodecError(f"unexpected fields in {kind!r}: {sorted(map(str, extra))}")
    out: dict[str, Any] = {}
    for name, spec in schema.fields.items():
        if name not in data and not spec.optional:
            raise CodecError(f"missing field {name!r} in {kind!r}")
        out[name] = _check_field(name, data.get(name), spec)
    if schema.check is not None:
        try:
            schema.check(out)
        except CodecError:
            raise
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise CodecError(f"invalid {kind!r}: {e}") from e
    return out
