"""The wire codec: msgpack inside an LZ4 frame, with numpy arrays as dtype + shape + raw bytes.

Every payload is a msgpack map ``{"v": SCHEMA_VERSION, "k": kind, "d": {field: value}}``
compressed as one LZ4 frame that records its content size. An array travels as a two-element
msgpack list: an extension (code 1) holding the header ``[dtype code: u8][ndim: u8][dims:
ndim x u32 little-endian]``, then the raw C-order bytes as ``bin`` (packed without an extra
copy, decoded with ``np.frombuffer``: decoded arrays are read-only views).

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
DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # decompressed size cap
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
_CODE_OF_DTYPE = {dt: i for i, dt in enumerate(_DTYPES)}
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


_LZ4_MAGIC = b"\x04\x22\x4d\x18"
_U64 = struct.Struct("<Q")
_HEADERS = [struct.Struct(f"<BB{n}I") for n in range(MAX_NDIM + 1)]


def _normalize(obj: np.ndarray) -> tuple[np.ndarray, int]:
    """``obj`` as a C-ordered little-endian array of an allowed dtype, and the dtype's code."""
    code = _CODE_OF_NAME.get(obj.dtype.name)
    if code is None:
        raise CodecError(f"dtype {obj.dtype} is not on the allow-list {sorted(ALLOWED_DTYPES)}")
    if obj.ndim > MAX_NDIM:
        raise CodecError(f"array has {obj.ndim} dimensions, more than {MAX_NDIM}")
    return np.asarray(obj, dtype=_DTYPES[code], order="C"), code  # 0-d stays 0-d


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        code = _CODE_OF_DTYPE.get(obj.dtype)  # fast path: little-endian, allowed, contiguous
        if code is None or obj.ndim > MAX_NDIM or not obj.flags.c_contiguous:
            obj, code = _normalize(obj)
        ndim = obj.ndim
        header = _HEADERS[ndim].pack(code, ndim, *obj.shape)
        data = memoryview(obj).cast("B") if obj.size else b""
        return [msgpack.ExtType(_EXT_ARRAY, header), data]
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


class _ArrayHeader:
    """A decoded, validated array header waiting for its bytes (see ``_list_hook``)."""

    __slots__ = ("dtype", "shape", "nbytes")

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape
        self.nbytes = math.prod(shape) * dtype.itemsize


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
    if len(data) != 2 + 4 * ndim:
        raise CodecError("array shape truncated or overlong")
    return _ArrayHeader(_DTYPES[dcode], _HEADERS[ndim].unpack(data)[2:])


def _list_hook(items: list[Any]) -> Any:
    if len(items) == 2 and type(items[0]) is _ArrayHeader:
        head, raw = items
        if type(raw) is not bytes:
            raise CodecError("array data is not bytes")
        if head.nbytes != len(raw):
            raise CodecError(
                f"array of shape {head.shape} and dtype {head.dtype.name} needs "
                f"{head.nbytes} bytes, payload has {len(raw)}"
            )
        return np.frombuffer(raw, dtype=head.dtype).reshape(head.shape)
    return items


def _decompress(payload: bytes, max_bytes: int) -> bytes:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    # read the declared content size from the frame header (magic, FLG, BD, size u64);
    # lz4 itself verifies the header checksum and enforces the size while inflating
    if len(payload) < 15 or payload[:4] != _LZ4_MAGIC:
        raise CodecError("not an LZ4 frame (bad magic or header too short)")
    if not payload[4] & 0x08:
        raise CodecError("LZ4 frame does not record its content size")
    size = _U64.unpack_from(payload, 6)[0]
    if size > max_bytes:
        raise CodecError(f"decompressed payload would be {size} bytes, over the {max_bytes} cap")
    try:
        # LZ4F enforces the recorded size: a frame that inflates past it fails, it does not grow
        out, used = lz4.frame.decompress(payload, return_bytes_read=True)
    except RuntimeError as e:
        raise CodecError(f"corrupt or truncated LZ4 frame: {e}") from e
    if used != len(payload):
        raise CodecError(f"{len(payload) - used} bytes of trailing data after the LZ4 frame")
    if len(out) != size:
        raise CodecError(f"LZ4 frame inflated to {len(out)} bytes, header says {size}")
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
        msg = msgpack.unpackb(
            raw, ext_hook=_ext_hook, list_hook=_list_hook, raw=False, strict_map_key=True
        )
    except CodecError:
        raise
    except Exception as e:  # msgpack raises several types for malformed input
        raise CodecError(f"malformed msgpack: {type(e).__name__}: {e}") from e
    try:
        version, kind, data = msg["v"], msg["k"], msg["d"]
        if len(msg) != 3:
            raise KeyError
    except (TypeError, KeyError, IndexError):
        raise CodecError("payload is not a qrl envelope {v, k, d}") from None
    if version != SCHEMA_VERSION or type(version) is not int:
        raise CodecError(f"unknown schema version {version!r} (this qrl speaks {SCHEMA_VERSION})")
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
