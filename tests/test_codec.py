import lz4.frame
import msgpack
import numpy as np
import pytest

from qrl.codec import (
    ALLOWED_DTYPES,
    SCHEMA_VERSION,
    CodecError,
    Field,
    Schema,
    decode,
    decode_any,
    encode,
)

BATCH = Schema(
    "batch",
    {
        "obs": Field(np.ndarray, dtypes=("uint8", "float32")),
        "reward": Field(np.ndarray, dtypes=("float32",), ndim=1, finite=True),
        "version": Field(int),
        "note": Field(str, optional=True),
    },
)

# every dtype and shape the system uses: Atari frames, vector obs, actions, rewards, flags,
# logits, priorities, parameters, scalars and empty batches
SHAPES = [(), (0,), (1,), (7,), (1024, 4), (256, 84, 84), (4, 84, 84), (20, 8, 6), (3, 0, 2)]


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_array_round_trip(dtype, shape):
    rng = np.random.default_rng(0)
    arr = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
    kind, data = decode_any(encode("x", {"a": arr}))
    out = data["a"]
    assert kind == "x"
    assert out.dtype == np.dtype(dtype) and out.shape == shape
    np.testing.assert_array_equal(out, arr)


def test_non_contiguous_and_big_endian_arrays_round_trip():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    for arr in (base.T, base[:, ::2], base.astype(">f4"), np.asfortranarray(base)):
        np.testing.assert_array_equal(decode_any(encode("x", {"a": arr}))[1]["a"], arr)


def test_scalars_and_nesting_round_trip():
    data = {
        "i": -3,
        "f": 1.5,
        "s": "héllo",
        "b": b"\x00\x01",
        "n": None,
        "t": True,
        "l": [1, 2.0, "x"],
        "d": {"inner": np.ones(3, np.int64)},
        "g": np.float32(2.5),
    }
    _, out = decode_any(encode("x", data))
    assert out["i"] == -3 and out["f"] == 1.5 and out["s"] == "héllo" and out["b"] == b"\x00\x01"
    assert out["n"] is None and out["t"] is True and out["l"] == [1, 2.0, "x"] and out["g"] == 2.5
    np.testing.assert_array_equal(out["d"]["inner"], np.ones(3))


def test_schema_accepts_valid_and_fills_optional():
    msg = {"obs": np.zeros((2, 4), np.float32), "reward": np.ones(2, np.float32), "version": 3}
    out = decode(encode("batch", msg), BATCH)
    assert out["version"] == 3 and out["note"] is None and out["obs"].shape == (2, 4)


def _batch(**over):
    msg = {"obs": np.zeros((2, 4), np.float32), "reward": np.ones(2, np.float32), "version": 3}
    msg.update(over)
    return msg


@pytest.mark.parametrize(
    "payload, reason",
    [
        (encode("other", _batch()), "expected a 'batch' message"),
        (encode("batch", {"obs": np.zeros(2, np.float32), "version": 1}), "missing field 'reward'"),
        (encode("batch", _batch(extra=1)), "unexpected fields"),
        (encode("batch", _batch(version="3")), "must be int"),
        (encode("batch", _batch(version=True)), "must be int"),
        (encode("batch", _batch(obs=np.zeros(2, np.int64))), "dtype int64"),
        (encode("batch", _batch(reward=np.ones((2, 1), np.float32))), "dimensions"),
        (encode("batch", _batch(reward=np.array([1, np.nan], np.float32))), "NaN"),
        (encode("batch", _batch(reward=np.array([np.inf], np.float32))), "NaN or infinity"),
        (encode("batch", _batch(note=None, version=None)), "field 'version' is null"),
    ],
)
def test_schema_rejects_with_reason(payload, reason):
    with pytest.raises(CodecError, match=reason):
        decode(payload, BATCH)


def _frame(obj) -> bytes:
    return lz4.frame.compress(msgpack.packb(obj, use_bin_type=True))


def _arr_ext(header: bytes, body: bytes) -> list:
    return [msgpack.ExtType(1, header), body]


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "not an LZ4 frame"),
        (b"not lz4 at all", "not an LZ4 frame"),
        (b"\x04\x22\x4d\x18\x68\x40" + b"\x00" * 9, "corrupt"),
        (lz4.frame.compress(msgpack.packb({}), store_size=False), "does not record its content"),
        (encode("x", {})[:-3], "truncated"),
        (encode("x", {}) + b"junk", "trailing data"),
        (_frame({"v": SCHEMA_VERSION + 1, "k": "x", "d": {}}), "unknown schema version"),
        (_frame({"v": SCHEMA_VERSION, "k": "x"}), "envelope"),
        (_frame([1, 2, 3]), "envelope"),
        (_frame({"v": SCHEMA_VERSION, "k": 5, "d": {}}), "kind is not a string"),
        (_frame({"v": SCHEMA_VERSION, "k": "x", "d": [1]}), "data is not a map"),
        (lz4.frame.compress(b"\xc1"), "malformed msgpack"),
        (
            _frame({"v": 1, "k": "x", "d": {"a": _arr_ext(b"\x63\x01\x02\x00\x00\x00", b"")}}),
            "dtype code 99",
        ),
        (
            _frame({"v": 1, "k": "x", "d": {"a": _arr_ext(b"\x01\x01\xff\xff\xff\xff", b"ab")}}),
            "needs 4294967295 bytes",
        ),
        (_frame({"v": 1, "k": "x", "d": {"a": _arr_ext(b"\x01\x09", b"")}}), "9 dimensions"),
        (_frame({"v": 1, "k": "x", "d": {"a": _arr_ext(b"\x01\x02\x01", b"")}}), "shape truncated"),
        (_frame({"v": 1, "k": "x", "d": {"a": _arr_ext(b"\x01\x00", "ab")}}), "not bytes"),
        (_frame({"v": 1, "k": "x", "d": {"a": msgpack.ExtType(7, b"")}}), "extension type 7"),
    ],
)
def test_decoder_rejects_malformed_with_reason(payload, reason):
    with pytest.raises(CodecError, match=reason):
        decode_any(payload)


def test_nested_values_must_be_plain():
    schema = Schema("x", {"a": Field(dict), "l": Field(list)})
    ok = {"a": {"b": [1, np.zeros(2)]}, "l": [{"c": "d"}]}
    assert decode(encode("x", ok), schema)["l"] == [{"c": "d"}]
    for bad in (
        {"a": {"b": msgpack.Timestamp(0)}, "l": []},
        {"a": {}, "l": [msgpack.Timestamp(1)]},
        {"a": {1: 2}, "l": []},
        {"a": {}, "l": msgpack.Timestamp(1)},
    ):
        with pytest.raises(CodecError):
            decode(_frame({"v": 1, "k": "x", "d": bad}), schema)


def test_decompression_bomb_is_capped():
    bomb = lz4.frame.compress(b"\x00" * (64 << 20))  # 64 MiB of zeros, ~250 KiB compressed
    assert len(bomb) < 1 << 20
    with pytest.raises(CodecError, match="cap"):
        decode_any(bomb, max_bytes=1 << 20)


def test_frame_lying_about_its_size_is_rejected_without_inflating():
    import struct

    lz4_frame = bytearray(lz4.frame.compress(b"\x00" * (32 << 20)))  # 32 MiB of zeros
    struct.pack_into("<Q", lz4_frame, 6, 1000)  # header claims 1000 bytes
    # fix the header checksum (xxh32 of the descriptor, second byte) with the lz4 library's
    # own check: try all 256 values, exactly one parses
    for hc in range(256):
        lz4_frame[14] = hc
        try:
            lz4.frame.get_frame_info(bytes(lz4_frame))
            break
        except RuntimeError:
            continue
    assert lz4.frame.get_frame_info(bytes(lz4_frame))["content_size"] == 1000
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CodecError, match="LZ4"):
        decode_any(bytes(lz4_frame))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 16 << 10  # KiB


def test_encode_refuses_unsupported_values():
    with pytest.raises(CodecError, match="allow-list"):
        encode("x", {"a": np.zeros(2, np.complex64)})
    with pytest.raises(CodecError, match="allow-list"):
        encode("x", {"a": np.array(["s"], dtype=object)})
    with pytest.raises(CodecError, match="cannot encode"):
        encode("x", {"a": object()})
    with pytest.raises(CodecError, match="dimensions"):
        encode("x", {"a": np.zeros((1,) * 9)})


def test_no_pickle_anywhere_in_the_package():
    import pathlib

    import qrl

    root = pathlib.Path(qrl.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, path
        assert "allow_pickle=True" not in text, path
