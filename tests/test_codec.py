import lz4.frame
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qrl.wire.codec import (
    ALLOWED_DTYPES,
    DEFAULT_MAX_BYTES,
    SCHEMA_VERSION,
    CodecError,
    Field,
    Schema,
    decode,
    encode,
)
from tests import strategies as hs

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
ANY = Schema("x", {"a": Field(np.ndarray, optional=True)})  # one array of any dtype and shape
SHAPES = [(), (0,), (1,), (7,), (1024, 4), (256, 84, 84), (4, 84, 84), (20, 8, 6), (3, 0, 2)]


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_array_round_trip(dtype, shape):
    rng = np.random.default_rng(0)
    arr = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
    out = decode(encode("x", {"a": arr}), ANY)["a"]
    assert out.dtype == np.dtype(dtype) and out.shape == shape
    np.testing.assert_array_equal(out, arr)


def test_non_contiguous_and_big_endian_arrays_round_trip():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    for arr in (base.T, base[:, ::2], base.astype(">f4"), np.asfortranarray(base)):
        np.testing.assert_array_equal(decode(encode("x", {"a": arr}), ANY)["a"], arr)


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
    schema = Schema(
        "x",
        {
            **{k: Field(type(v)) for k, v in data.items() if k not in "ndg"},
            "n": Field(str, optional=True),
            "d": Field(dict, values=Field(np.ndarray, dtypes=("int64",))),
            "g": Field(float),
        },
    )
    out = decode(encode("x", data), schema)
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


def _arr(header: bytes, body: bytes) -> list:
    return [header, body]


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "not an LZ4 frame"),
        (b"not lz4 at all", "not an LZ4 frame"),
        (b"\x04\x22\x4d\x18\x68\x40" + b"\x00" * 9, "corrupt"),
        (lz4.frame.compress(msgpack.packb({}), store_size=False), "does not record its content"),
        (encode("x", {})[:-3], "truncated"),
        (encode("x", {}) + b"junk", "trailing data"),
        (_frame([SCHEMA_VERSION + 1, "x", {}]), "unknown schema version"),
        (_frame([SCHEMA_VERSION, "x"]), "envelope"),
        (_frame({"v": SCHEMA_VERSION, "k": "x", "d": {}}), "envelope"),
        (_frame([SCHEMA_VERSION, 5, {}]), "kind is not a string"),
        (_frame([SCHEMA_VERSION, "x", [1]]), "data is not a map"),
        (_frame([SCHEMA_VERSION, "y", {}]), "expected a 'x' message"),
        (lz4.frame.compress(b"\xc1"), "malformed msgpack"),
        (_frame([1, "x", {"a": _arr(b"\x63\x01\x02\x00\x00\x00", b"")}]), "dtype code 99"),
        (
            _frame([1, "x", {"a": _arr(b"\x01\x01\xff\xff\xff\xff", b"ab")}]),
            "needs 4294967295 bytes",
        ),
        (_frame([1, "x", {"a": _arr(b"\x01\x09", b"")}]), "9 dimensions"),
        (_frame([1, "x", {"a": _arr(b"\x01\x02\x01", b"")}]), "shape truncated"),
        (_frame([1, "x", {"a": _arr(b"\x01", b"")}]), "header truncated"),
        (_frame([1, "x", {"a": _arr(b"\x01\x00", "ab")}]), "must be bytes"),
        (_frame([1, "x", {"a": [b"\x01\x00"]}]), "must be array"),
        (_frame([1, "x", {"a": msgpack.ExtType(7, b"")}]), "must be array, got ExtType"),
    ],
)
def test_decoder_rejects_malformed_with_reason(payload, reason):
    with pytest.raises(CodecError, match=reason):
        decode(payload, ANY)


def test_nested_values_must_be_plain():
    schema = Schema("x", {"a": Field(dict), "l": Field(list)})
    ok = {"a": {"b": [1, 2.5, None]}, "l": [{"c": "d"}]}
    assert decode(encode("x", ok), schema) == ok
    for bad, reason in (
        # msgpack extension types (timestamps) are refused by msgpack itself
        ({"a": {"b": msgpack.Timestamp(0)}, "l": []}, "exceeds max_ext_len"),
        ({"a": {}, "l": [msgpack.Timestamp(1)]}, "exceeds max_ext_len"),
        ({"a": {b"k": 2}, "l": []}, "non-string key b'k'"),
        ({"a": {}, "l": msgpack.Timestamp(1)}, "exceeds max_ext_len"),
    ):
        with pytest.raises(CodecError, match=reason):
            decode(_frame([1, "x", bad]), schema)


def test_map_of_arrays_checks_every_value():
    schema = Schema("x", {"p": Field(dict, values=Field(np.ndarray, finite=True))})
    params = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float64)}
    out = decode(encode("x", {"p": params}), schema)["p"]
    assert out.keys() == params.keys()
    for k in params:
        np.testing.assert_array_equal(out[k], params[k])
        assert out[k].dtype == params[k].dtype
    for bad, reason in (
        ({"w": np.array([np.nan], np.float32)}, "'p.w' contains NaN"),
        ({"w": 3}, "'p.w' must be array"),
        ({"w": [b"\x0a\x01\x02\x00\x00\x00", b"abc"]}, "needs 8 bytes"),
    ):
        with pytest.raises(CodecError, match=reason):
            decode(encode("x", {"p": bad}), schema)
    with pytest.raises(CodecError, match="non-string key"):
        decode(_frame([1, "x", {"p": {b"w": [b"\x00\x00", b"\x00"]}}]), schema)


def test_decompression_bomb_is_capped():
    bomb = lz4.frame.compress(b"\x00" * (64 << 20))  # 64 MiB of zeros, ~250 KiB compressed
    assert len(bomb) < 1 << 20
    with pytest.raises(CodecError, match="cap"):
        decode(bomb, ANY, max_bytes=1 << 20)


def test_frame_lying_about_its_size_is_rejected_without_inflating():
    import struct
    import tracemalloc

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
    payload = bytes(lz4_frame)
    # tracemalloc sees lz4's and numpy's buffers: the peak is what decoding allocated, not
    # what this test did before (the 32 MiB above are freed and not counted)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="LZ4 frame inflates past the 1000 bytes"):
            decode(payload, ANY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_encode_refuses_unsupported_values():
    with pytest.raises(CodecError, match="allow-list"):
        encode("x", {"a": np.zeros(2, np.complex64)})
    with pytest.raises(CodecError, match="allow-list"):
        encode("x", {"a": np.array(["s"], dtype=object)})
    with pytest.raises(CodecError, match="cannot encode"):
        encode("x", {"a": object()})
    with pytest.raises(CodecError, match="dimensions"):
        encode("x", {"a": np.zeros((1,) * 9)})


def test_encode_refuses_a_message_no_reader_would_take():
    # every schema's cap is at most DEFAULT_MAX_BYTES: a bigger message would be written,
    # then rejected by every reader (weights of too big a network: actors waited for ever).
    # Zeros compress best: encode sizes only payloads LZ4 could have packed that far
    with pytest.raises(CodecError, match="'weights' message of .* over the .* cap"):
        encode("weights", {"a": np.zeros(DEFAULT_MAX_BYTES, np.uint8)})
    with pytest.raises(ValueError, match="max_bytes"):
        Schema("x", {}, max_bytes=DEFAULT_MAX_BYTES + 1)
    near = np.ones(DEFAULT_MAX_BYTES - 64, np.uint8)  # the header and the map fit beside it
    assert decode(encode("x", {"a": near}), ANY)["a"].nbytes == near.nbytes


def test_no_pickle_anywhere_in_the_package():
    import pathlib

    import qrl

    root = pathlib.Path(qrl.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, path
        assert "allow_pickle=True" not in text, path


def test_failed_encode_leaves_nothing_behind_and_threads_do_not_mix():
    from concurrent.futures import ThreadPoolExecutor

    with pytest.raises(CodecError):
        encode("x", {"a": np.zeros(3), "b": object()})  # fails after packing part of the map
    assert decode(encode("x", {"a": np.arange(3.0)}), ANY)["a"].tolist() == [0.0, 1.0, 2.0]

    def round_trip(i: int) -> bool:
        arr = np.full((64, i + 1), i, np.int32)
        return all((decode(encode("x", {"a": arr}), ANY)["a"] == arr).all() for _ in range(200))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(round_trip, range(16)))


def _empty_but_huge(ndim_field: bool) -> bytes:
    """Issue 12, finding 1: a 0-byte array of shape (0, 2**31-1, 2**31-1)."""
    import struct

    head = struct.pack("<BB3I", 10, 3, 0, 2**31 - 1, 2**31 - 1)  # float32
    return _frame([SCHEMA_VERSION, "x", {"a": [head, b""]}])


@pytest.mark.parametrize("ndim", [None, 3])
def test_empty_array_with_huge_dimensions_is_a_codec_error(ndim):
    schema = Schema("x", {"a": Field(np.ndarray, ndim=ndim, finite=True)})
    with pytest.raises(CodecError, match="too large"):
        decode(_empty_but_huge(ndim is not None), schema)
    # an empty array with sane dimensions still decodes
    assert decode(encode("x", {"a": np.zeros((0, 84, 84), np.float32)}), schema)["a"].shape == (
        0,
        84,
        84,
    )


def _valid_messages() -> list[tuple[Schema, st.SearchStrategy[dict]]]:
    """Every message schema, with a strategy for messages it admits."""
    from qrl.algos.apex_family.messages import experience_schema, frames_schema
    from qrl.algos.es.messages import es_results_schema
    from qrl.algos.impala.messages import unroll_schema
    from qrl.algos.r2d2.messages import sequence_schema
    from qrl.wire.weights import WEIGHTS

    fitting = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    return [
        (experience_schema((4,), "float32", 2, 64), hs.experience()),
        (frames_schema((4, 6, 6), 6, 64), hs.frames()),
        (unroll_schema((4,), "float32", 2, 5, 8), hs.unrolls(5, 8)),
        (es_results_schema(4, 10_000, 100), hs.es_results(4, 10_000, 100)),
        (sequence_schema((2,), "float32", 2, 20, 8), hs.sequences(20, 8)),
        (WEIGHTS, hs.weights(fitting)),
    ]


@pytest.mark.parametrize("case", range(6), ids=lambda i: f"schema{i}")
@settings(hs.HOSTILE, max_examples=10)
@given(data=st.data())
def test_every_message_schema_survives_the_empty_huge_array(case, data):
    """A valid message of each schema with one array (or one array of a map of them)
    replaced by a 0-byte array of shape (0, 2**31-1, 2**31-1): refused by that field's name
    as too large, not by numpy (issue 12, finding 1)."""
    schema, messages = _valid_messages()[case]
    msg = data.draw(messages)
    decode(encode(schema.kind, msg), schema)  # admitted as it is
    head = __import__("struct").pack("<BB3I", 10, 3, 0, 2**31 - 1, 2**31 - 1)
    envelope = msgpack.unpackb(lz4.frame.decompress(encode(schema.kind, msg)))
    arrays = [n for n, f in schema.fields.items() if f.type is np.ndarray or f.values]
    assert arrays
    for name in arrays:
        if schema.fields[name].values is None:
            value, where = [head, b""], name
        else:  # a map of arrays: the huge one beside the others
            value = {**envelope[2][name], "w": [head, b""]}
            where = f"{name}.w"
        huge = [*envelope[:2], {**envelope[2], name: value}]
        with pytest.raises(CodecError, match=rf"field '{where}': array shape .* is too large"):
            decode(_frame(huge), schema)


def test_container_bomb_is_refused_at_its_first_header():
    """Issue 12, finding 2: a million empty lists, 4 KiB compressed, used to cost ~70 MiB
    before the schema check; msgpack's limits from the schema refuse it before building."""
    import tracemalloc

    from qrl.algos.impala.messages import unroll_schema

    bomb = lz4.frame.compress(msgpack.packb([SCHEMA_VERSION, "x", {"a": [[]] * 1_000_000}]))
    assert len(bomb) < 8192
    for schema in (ANY, unroll_schema((4,), "float32", 2, 20)):
        tracemalloc.start()
        try:
            with pytest.raises(CodecError, match="exceeds max_array_len"):
                decode(bomb, schema, max_bytes=DEFAULT_MAX_BYTES)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20  # the decompressed 1 MB, not a million lists


def test_schema_limits_follow_its_fields():
    schema = Schema(
        "k",
        {
            "s": Field(str, max_len=1000),
            "l": Field(list, max_len=5000),
            "p": Field(dict, values=Field(np.ndarray), max_len=7),
        },
        max_bytes=1 << 16,
    )
    lim = schema.limits
    assert lim["max_str_len"] == 1000 and lim["max_array_len"] == 5000
    assert lim["max_bin_len"] == 1 << 16 and lim["max_ext_len"] == 0
    ok = {"s": "a" * 1000, "l": list(range(5000)), "p": {str(i): np.zeros(1) for i in range(7)}}
    assert decode(encode("k", ok), schema)["s"] == ok["s"]
    for bad, reason in (
        ({**ok, "s": "a" * 1001}, "max_str_len"),
        ({**ok, "l": list(range(5001))}, "max_array_len"),
        ({**ok, "p": {str(i): np.zeros(1) for i in range(8)}}, "8 items, over 7"),
    ):
        with pytest.raises(CodecError, match=reason):
            decode(encode("k", bad), schema)
    # the schema's payload cap applies by default
    with pytest.raises(CodecError, match="cap"):
        decode(encode("k", {**ok, "l": [b"x" * 70_000]}), schema)


def test_bounds_on_numbers_and_arrays():
    schema = Schema(
        "b",
        {
            "n": Field(int),
            "f": Field(float, bounds=(0, 1)),
            "a": Field(np.ndarray, bounds=(-2, 2)),
        },
    )
    ok = {"n": 3, "f": 0.5, "a": np.array([-2.0, 2.0])}
    assert decode(encode("b", ok), schema)["n"] == 3
    for bad, reason in (
        ({**ok, "n": 2**64 - 1}, "out of"),
        ({**ok, "f": 1.5}, "out of"),
        ({**ok, "a": np.array([0.0, 3e38], np.float32)}, "out of"),
    ):
        with pytest.raises(CodecError, match=reason):
            decode(encode("b", bad), schema)


def test_more_containers_than_the_count_allows_are_refused():
    """Lists and maps are counted in a payload that could hold more than MAX_CONTAINERS (a
    schema with list fields): 5,000 empty lists, each one byte, are refused."""
    from qrl.wire.schema import MAX_CONTAINERS

    lists = Schema("x", {"a": Field(list, max_len=10_000)})
    ok = [SCHEMA_VERSION, "x", {"a": [[]] * (MAX_CONTAINERS - 3)}]
    assert decode(_frame(ok), lists)["a"] == [[]] * (MAX_CONTAINERS - 3)
    bomb = [SCHEMA_VERSION, "x", {"a": [[]] * 5_000}]
    with pytest.raises(CodecError, match=f"more than {MAX_CONTAINERS} lists and maps"):
        decode(_frame(bomb), lists)


def test_a_flat_schema_refuses_nested_containers_it_does_not_count():
    """A small payload of a flat schema (arrays and scalars) decodes without the count; a
    container where an array goes is still refused by the schema."""
    nested = [SCHEMA_VERSION, "x", {"a": [[[]] * 2, [[]] * 2]}]
    assert len(msgpack.packb(nested)) <= ANY.uncounted_bytes
    with pytest.raises(CodecError, match="array header and data must be bytes"):
        decode(_frame(nested), ANY)


def test_a_decompression_context_left_mid_frame_is_not_reused():
    """Each thread reuses its context: after truncated, lying and trailing-data frames (in
    any order) every valid payload still decodes, from several threads at once."""
    import threading

    good = encode("x", {"a": np.arange(5000, dtype=np.int32)})
    lying = bytearray(lz4.frame.compress(b"\x00" * 100_000))
    lying[6:14] = (10).to_bytes(8, "little")
    bad = [good[: len(good) // 2], good[:-4], good + b"\x00", bytes(lying), b"\x04\x22\x4d\x18"]
    for payload in bad * 3:
        with pytest.raises(CodecError):
            decode(payload, ANY)
        np.testing.assert_array_equal(decode(good, ANY)["a"], np.arange(5000))
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for i in range(300):
                with pytest.raises(CodecError):
                    decode(bad[i % len(bad)], ANY)
                np.testing.assert_array_equal(decode(good, ANY)["a"], np.arange(5000))
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
