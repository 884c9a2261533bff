"""A corpus of malformed payloads for a message kind, built from one valid message.

Every category the reliability issue names: random bytes, truncated and bit-flipped LZ4
frames, bit flips inside the msgpack, decompression bombs and frames lying about their size,
a wrong schema version, missing and extra fields, arrays whose shape disagrees with their
bytes, wrong dtypes, NaN/inf values, absurd dimensions, wrong types, and valid payloads of
another algorithm. Payloads that a mutation happens to leave valid (a flipped bit inside a
float, say) are not malformed and are left out: each one returned is checked to be rejected
by ``decode`` with ``schema``, so a consumer must dead-letter every one of them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

import lz4.frame
import msgpack
import numpy as np

from qrl.wire.codec import CodecError, Schema, decode, encode

Mutation = Callable[[np.random.Generator], bytes]


def _frame(obj: Any) -> bytes:
    return lz4.frame.compress(msgpack.packb(obj, use_bin_type=True))


def _flip(data: bytes, rng: np.random.Generator, lo: int = 0) -> bytes:
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 9))):
        i = int(rng.integers(lo, len(buf)))
        buf[i] ^= 1 << int(rng.integers(0, 8))
    return bytes(buf)


def mutations(kind: str, msg: dict[str, Any], other: bytes) -> dict[str, Mutation]:
    """Named generators of malformed payloads; ``other`` is a valid payload of another kind."""
    good = encode(kind, msg)
    raw = lz4.frame.decompress(good)
    version, _, wire = msgpack.unpackb(raw)  # the fields as they travel
    # where the arrays are: top-level fields, or one level down in a map of named arrays
    paths: list[tuple[str, ...]] = []
    for k, v in wire.items():
        if isinstance(v, list) and len(v) == 2:
            paths.append((k,))
        elif isinstance(v, dict):
            paths += [(k, sub) for sub, a in v.items() if isinstance(a, list) and len(a) == 2]

    def get(tree: dict, path: tuple[str, ...]) -> Any:
        return tree[path[0]] if len(path) == 1 else tree[path[0]][path[1]]

    def put(tree: dict, path: tuple[str, ...], value: Any) -> dict:
        if len(path) == 1:
            return {**tree, path[0]: value}
        return {**tree, path[0]: {**tree[path[0]], path[1]: value}}

    floats = [p for p in paths if np.asarray(get(msg, p)).dtype.kind == "f" and get(msg, p).size]
    names = list(wire)

    def with_fields(rng: np.random.Generator, change: Callable[[dict, str], None]) -> bytes:
        fields = dict(wire)
        change(fields, names[int(rng.integers(len(names)))])
        return _frame([version, kind, fields])

    def pick(rng: np.random.Generator, among: list[tuple[str, ...]]) -> tuple[str, ...]:
        return among[int(rng.integers(len(among)))]

    def bad_shape(rng: np.random.Generator) -> bytes:
        path = pick(rng, paths)
        head, data = get(wire, path)
        ndim = head[1]
        dims = list(struct.unpack_from(f"<{ndim}I", head, 2)) or [1]
        dims[int(rng.integers(len(dims)))] += int(rng.integers(1, 5))
        head = struct.pack(f"<BB{len(dims)}I", head[0], len(dims), *dims)
        return _frame([version, kind, put(wire, path, [head, data])])

    def bad_dtype(rng: np.random.Generator) -> bytes:
        path = pick(rng, paths)
        if rng.random() < 0.2:  # not on the allow-list at all: forge the dtype code
            head, data = get(wire, path)
            return _frame([version, kind, put(wire, path, [bytes([200]) + head[1:], data])])
        arr = np.asarray(get(msg, path))
        return encode(kind, put(msg, path, arr.astype(np.int16 if arr.dtype.kind == "f" else "f8")))

    def non_finite(rng: np.random.Generator) -> bytes:
        path = pick(rng, floats)
        arr = np.array(get(msg, path), copy=True)
        arr.flat[int(rng.integers(arr.size))] = [np.nan, np.inf, -np.inf][int(rng.integers(3))]
        return encode(kind, put(msg, path, arr))

    def absurd_dims(rng: np.random.Generator) -> bytes:
        path = pick(rng, paths)
        ndim = int(rng.integers(1, 9))
        head = struct.pack(f"<BB{ndim}I", get(wire, path)[0][0], ndim, *([0xFFFFFFFF] * ndim))
        return _frame([version, kind, put(wire, path, [head, b"\x00" * 16])])

    def lying_size(rng: np.random.Generator) -> bytes:
        frame = bytearray(good)
        struct.pack_into("<Q", frame, 6, int(rng.integers(1 << 27, 1 << 62)))
        return bytes(frame)  # header checksum now wrong, or size over the cap: both refused

    def wrong_type(rng: np.random.Generator) -> bytes:
        bad = [None, "text", 3.5, [1, 2], {"a": 1}, b"bytes", True][int(rng.integers(7))]
        return with_fields(rng, lambda f, n: f.__setitem__(n, bad))

    arrays_only = ("shape disagrees with bytes", "wrong dtype", "NaN or inf", "absurd dimensions")
    gens: dict[str, Mutation] = {
        "random bytes": lambda rng: rng.bytes(int(rng.integers(0, 300))),
        "truncated frame": lambda rng: good[: int(rng.integers(0, len(good)))],
        "bit-flipped frame": lambda rng: _flip(good, rng),
        "bit-flipped msgpack": lambda rng: lz4.frame.compress(_flip(raw, rng)),
        "frame lying about its size": lying_size,
        "wrong schema version": lambda rng: _frame([int(rng.integers(2, 1000)), kind, wire]),
        "missing field": lambda rng: with_fields(rng, lambda f, n: f.pop(n)),
        "extra field": lambda rng: _frame([version, kind, {**wire, f"x{rng.integers(99)}": 1}]),
        "shape disagrees with bytes": bad_shape,
        "wrong dtype": bad_dtype,
        "NaN or inf": non_finite,
        "absurd dimensions": absurd_dims,
        "wrong type": wrong_type,
        "another algorithm's payload": lambda rng: other,
    }
    if not floats:
        gens.pop("NaN or inf")
    if not paths:  # a message without arrays
        for name in arrays_only:
            gens.pop(name, None)
    return gens


BOMB = lz4.frame.compress(b"\x00" * (65 << 20))  # 65 MiB of zeros: over the 64 MiB cap


def corpus(
    kind: str,
    msg: dict[str, Any],
    schema: Schema,
    other: bytes,
    n: int,
    seed: int = 0,
    bombs: int = 2,
) -> Iterator[tuple[str, bytes]]:
    """``n`` malformed payloads ``(category, bytes)``: ``bombs`` real decompression bombs,
    then every category in turn (starting at ``seed``); each is rejected by
    ``decode(payload, schema)``."""
    # from a valid message only: one the schema refuses makes every mutation rejected for
    # the base's own fault, whatever the mutation did
    decode(encode(kind, msg), schema)
    rng = np.random.default_rng(seed)
    gens = list(mutations(kind, msg, other).items())
    made = 0
    for _ in range(min(bombs, n)):
        made += 1
        yield "decompression bomb", BOMB
    turn = seed
    while made < n:
        category, gen = gens[turn % len(gens)]
        turn += 1
        payload = gen(rng)
        try:
            decode(payload, schema)
        except CodecError:
            made += 1
            yield category, payload
