"""What a message may hold: fields, schemas and the array header, checked on decode.

A :class:`Schema` names a message kind and its fields (:class:`Field`);
:mod:`qrl.wire.codec` decodes
against it. Fields carry types, dtypes, dimensions, finiteness, bounds and lengths; a
schema carries its cross-field check, its payload cap and the msgpack limits that follow
from its fields. Every failure is a :class:`CodecError` saying what was wrong.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # the decompressed size cap: no schema's is higher
MAX_NDIM = 8
MAX_ARRAY_EXTENT = 1 << 32  # bytes a shape may describe, with its zero dimensions taken as 1
MAX_STR = 256  # default longest str field, map key or plain string
MAX_ITEMS = 1024  # default longest list or map field
MAX_CONTAINERS = 4096  # lists and maps in one message (an array is one list)
FLAT_UNCOUNTED = 64 * 1024  # payload bytes a flat schema decodes without counting containers
INT_BOUND = 1 << 53  # default |int field| (exact as a float, safe in int64 arithmetic)

# dtype allow-list: code <-> little-endian numpy dtype
_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "uint64",
        "int64",
        "float16",
        "float32",
        "float64",
    )
)
_CODE_OF_NAME = {dt.name: i for i, dt in enumerate(_DTYPES)}
ALLOWED_DTYPES: frozenset[str] = frozenset(dt.name for dt in _DTYPES)
_HEADERS = [struct.Struct(f"<BB{n}I") for n in range(MAX_NDIM + 1)]


def size_cap(nbytes: int) -> int:
    """A payload cap for messages of about ``nbytes``: twice that, plus 64 KiB of slack."""
    return min(2 * int(nbytes) + 65_536, DEFAULT_MAX_BYTES)


class CodecError(ValueError):
    """A payload could not be encoded or failed validation on decode; the message says why."""


# --------------------------------------------------------------------------- schema

_TYPE_NAMES = {np.ndarray: "array", bytes: "bytes", str: "str", int: "int", float: "float"}


@dataclass(frozen=True)
class Field:
    """One expected field of a message.

    ``type`` is one of ``int, float, str, bytes, bool, list, dict, np.ndarray``. For arrays,
    ``dtypes`` restricts the dtype, ``ndim`` the number of dimensions, and ``finite`` rejects
    NaN and infinity. ``bounds`` ``(lo, hi)`` bounds a number or every element of an array
    (ints default to ``+-INT_BOUND``). A ``dict`` with ``values`` is a map from names to
    values of that field (e.g. named arrays); without it, a dict or list holds plain values
    only. ``max_len`` caps a str, list or dict (default ``MAX_STR``, ``MAX_ITEMS``).
    ``optional`` fields may be absent (decoded as ``None``).
    """

    type: type
    dtypes: tuple[str, ...] | None = None
    ndim: int | None = None
    finite: bool = False
    optional: bool = False
    values: Field | None = None
    bounds: tuple[float, float] | None = None
    max_len: int | None = None

    @property
    def longest(self) -> int:
        """The most characters (str) or items (list, dict) this field admits."""
        return self.max_len or (MAX_STR if self.type is str else MAX_ITEMS)

    def check(self, name: str, value: Any) -> Any:
        """``value`` checked (and, for arrays, built) as this field; raises CodecError."""
        if self.type is np.ndarray and value is not None:
            return self._array(name, value)
        if value is None:
            if self.optional:
                return None
            raise CodecError(f"field {name!r} is null")
        t = self.type
        if t is float and type(value) is int:
            value = float(value)
        if not isinstance(value, t) or (t is int and type(value) is bool):
            want = _TYPE_NAMES.get(t, t.__name__)
            raise CodecError(f"field {name!r} must be {want}, got {type(value).__name__}")
        if t is float and self.finite and not math.isfinite(value):
            raise CodecError(f"field {name!r} is not finite ({value})")
        if t in (int, float):
            lo, hi = self.bounds or (-INT_BOUND, INT_BOUND)
            if not lo <= value <= hi and (t is int or self.bounds is not None):
                raise CodecError(f"field {name!r} is {value}, out of [{lo}, {hi}]")
        elif t in (str, list, dict) and len(value) > self.longest:
            raise CodecError(f"field {name!r} holds {len(value)} items, over {self.longest}")
        if self.values is not None and t is dict:
            out = {}
            for k, v in value.items():
                if type(k) is not str:
                    raise CodecError(f"field {name!r} has a non-string key {k!r}")
                out[k] = self.values.check(f"{name}.{k}", v)
            return out
        if t in (dict, list):
            _check_plain(name, value)
        return value

    def _array(self, name: str, value: Any) -> np.ndarray:
        if type(value) is not list or len(value) != 2:
            raise CodecError(f"field {name!r} must be array, got {type(value).__name__}")
        head, raw = value
        if type(head) is not bytes or type(raw) is not bytes:
            raise CodecError(f"field {name!r}: array header and data must be bytes")
        try:
            dtype, dname, shape, nbytes = _HEADER_CACHE[head]
        except KeyError:
            dtype, dname, shape, nbytes = _parse_header(name, head)
        if nbytes != len(raw):
            raise CodecError(
                f"field {name!r}: array of shape {shape} and dtype {dname} needs "
                f"{nbytes} bytes, payload has {len(raw)}"
            )
        return self.check_array(name, np.ndarray(shape, dtype, raw))  # a view, no copy

    def check_array(self, name: str, arr: np.ndarray) -> np.ndarray:
        """``arr``, built already (e.g. from chunks: :mod:`qrl.wire.chunks`), checked against
        this field's dtypes, dimensions, finiteness and bounds; raises CodecError."""
        dname = arr.dtype.name
        if self.dtypes is not None and dname not in self.dtypes:
            raise CodecError(f"field {name!r} has dtype {dname}, expected {self.dtypes}")
        if self.ndim is not None and arr.ndim != self.ndim:
            raise CodecError(f"field {name!r} has {arr.ndim} dimensions, expected {self.ndim}")
        if self.finite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise CodecError(f"field {name!r} contains NaN or infinity")
        if self.bounds is not None and arr.size:
            lo, hi = self.bounds
            if arr.min() < lo or arr.max() > hi:
                raise CodecError(f"field {name!r} has values out of [{lo}, {hi}]")
        return arr


# array headers repeat (every batch of a run has the same shapes): parse each once
_HEADER_CACHE: dict[bytes, tuple[np.dtype, str, tuple[int, ...], int]] = {}
_HEADER_CACHE_SIZE = 1024


def _parse_header(name: str, head: bytes) -> tuple[np.dtype, str, tuple[int, ...], int]:
    """(dtype, dtype name, shape, byte count) from an array header, checked and cached."""
    if len(head) < 2:
        raise CodecError(f"field {name!r}: array header truncated")
    dcode, ndim = head[0], head[1]
    if dcode >= len(_DTYPES):
        raise CodecError(f"field {name!r}: array dtype code {dcode} is not on the allow-list")
    if ndim > MAX_NDIM:
        raise CodecError(f"field {name!r}: array has {ndim} dimensions, more than {MAX_NDIM}")
    if len(head) != 2 + 4 * ndim:
        raise CodecError(f"field {name!r}: array shape truncated or overlong")
    dtype, shape = _DTYPES[dcode], _HEADERS[ndim].unpack(head)[2:]
    # an empty array may name huge dimensions beside its zero (0 bytes, yet numpy refuses it)
    if math.prod(d or 1 for d in shape) * dtype.itemsize > MAX_ARRAY_EXTENT:
        raise CodecError(f"field {name!r}: array shape {shape} is too large")
    parsed = dtype, dtype.name, shape, math.prod(shape) * dtype.itemsize
    if len(_HEADER_CACHE) >= _HEADER_CACHE_SIZE:
        _HEADER_CACHE.clear()
    _HEADER_CACHE[head] = parsed
    return parsed


class Decoding(NamedTuple):
    """What :func:`qrl.wire.codec.decode` reads of a schema, in one lookup (a small payload's
    decode is mostly such lookups); decode unpacks it in this order."""

    max_bytes: int
    max_str_len: int  # msgpack's limits (:attr:`Schema.limits`)
    max_items: int  # longest list or map
    max_bin_len: int
    uncounted_bytes: int
    kind: str
    names: Any  # the field names (a keys view)
    plan: tuple[tuple[str, Field, bool, bool], ...]  # (name, field, is an array, optional)
    check: Callable[[dict[str, Any]], None] | None


@dataclass(frozen=True)
class Schema:
    """A message kind and its fields. ``check`` may add cross-field validation; it raises
    :class:`CodecError` (or ``ValueError``) on a bad message. ``max_bytes`` caps a payload's
    decompressed size (size it to the largest message a run sends)."""

    kind: str
    fields: Mapping[str, Field]
    check: Callable[[dict[str, Any]], None] | None = field(default=None, compare=False)
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if not 0 < self.max_bytes <= DEFAULT_MAX_BYTES:  # encode refuses anything larger
            raise ValueError(
                f"{self.kind}: max_bytes {self.max_bytes} not in 1..{DEFAULT_MAX_BYTES}"
            )

    @cached_property
    def uncounted_bytes(self) -> int:
        """Payloads up to this many bytes decode without counting their lists and maps (a
        Python call per container). None holds more containers than bytes, so up to
        ``MAX_CONTAINERS`` bytes the count cannot be exceeded; and a flat schema (arrays and
        scalars only) refuses every message with more than its own few containers, so up to
        ``FLAT_UNCOUNTED`` bytes the count would only bound work that is small anyway."""
        flat = all(f.type not in (list, dict) for f in self.fields.values())
        return max(FLAT_UNCOUNTED, MAX_CONTAINERS) if flat else MAX_CONTAINERS

    @cached_property
    def decoding(self) -> Decoding:
        """This schema as :func:`qrl.wire.codec.decode` reads it (:class:`Decoding`)."""
        lim = self.limits
        plan = tuple((n, f, f.type is np.ndarray, f.optional) for n, f in self.fields.items())
        return Decoding(
            self.max_bytes,
            lim["max_str_len"],
            lim["max_array_len"],
            lim["max_bin_len"],
            self.uncounted_bytes,
            self.kind,
            self.fields.keys(),
            plan,
            self.check,
        )

    @cached_property
    def limits(self) -> dict[str, int]:
        """msgpack's limits for this schema: the longest string, list and map it admits."""
        strs, items = [MAX_STR, len(self.kind), *map(len, self.fields)], [3, len(self.fields)]
        for f in self.fields.values():
            for g in (f, f.values) if f.values is not None else (f,):
                if g.type is str:
                    strs.append(g.longest)
                elif g.type in (list, dict):
                    items.append(g.longest)
                    strs.append(MAX_STR)  # keys and plain strings inside
        return {
            "max_str_len": max(strs),
            "max_array_len": max(items),
            "max_map_len": max(items),
            "max_bin_len": self.max_bytes,
            "max_ext_len": 0,
        }


_PLAIN = (type(None), bool, int, float, str, bytes)


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
