"""Property-based: corrupted payloads make the decoder raise only CodecError, never crash."""

import lz4.frame
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qrl.wire.codec import CodecError, Field, Schema, decode, encode

SCHEMA = Schema(
    "batch",
    {
        "obs": Field(np.ndarray, dtypes=("uint8",), ndim=3),
        "reward": Field(np.ndarray, dtypes=("float32",), ndim=1, finite=True),
        "meta": Field(dict),
        "version": Field(int),
    },
)
VALID = [
    encode(
        "batch",
        {
            "obs": np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
            "reward": np.array([1.0, -2.5], np.float32),
            "meta": {"a": [1, "b"]},
            "version": 7,
        },
    ),
    encode(
        "batch",
        {
            "obs": np.zeros((0, 84, 84), np.uint8),
            "reward": np.zeros(0, np.float32),
            "meta": {},
            "version": 0,
        },
    ),
]
RAW = [lz4.frame.decompress(v) for v in VALID]


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, val in edits:
        if not buf:
            buf.append(val)
            continue
        i = pos % len(buf)
        if op == 0:
            buf[i] ^= 1 << (val % 8)  # bit flip
        elif op == 1:
            buf[i] = val  # byte overwrite
        elif op == 2:
            buf.insert(i, val)  # insertion
        elif op == 3:
            del buf[i:]  # truncation
        else:
            del buf[i]  # deletion
    return bytes(buf)


edits = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 1 << 20), st.integers(0, 255)),
    min_size=1,
    max_size=8,
)
# corrupt the compressed frame, or corrupt the msgpack inside a valid frame, or random bytes,
# or random msgpack values in a valid frame
payloads = st.one_of(
    st.binary(max_size=2048),
    st.builds(_mutate, st.sampled_from(VALID), edits),
    st.builds(lambda raw, e: lz4.frame.compress(_mutate(raw, e)), st.sampled_from(RAW), edits),
    st.builds(
        lambda obj: lz4.frame.compress(msgpack.packb(obj, use_bin_type=True)),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**63), 2**64 - 1)
            | st.floats()
            | st.text()
            | st.binary(),
            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
            max_leaves=12,
        ).map(lambda d: [1, "batch", d] if isinstance(d, dict) else d),
    ),
)


@pytest.mark.slow
@settings(
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(payloads)
def test_decoder_raises_only_codec_error(payload):
    try:
        out = decode(payload, SCHEMA, max_bytes=1 << 16)
    except CodecError as e:
        assert str(e)  # every rejection says why
    else:  # a mutation that still decodes must still satisfy the schema
        assert out["obs"].dtype == np.uint8 and out["obs"].ndim == 3
        assert np.isfinite(out["reward"]).all() and isinstance(out["version"], int)
