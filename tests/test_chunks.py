"""Messages of any size in chunks under a versioned manifest (qrl/wire/chunks.py), through
a real Redis: round trips exact (and within bf16/fp16 precision), the switch atomic, a
half-written version never read, hostile chunks and manifests rejected without a crash."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from qrl.wire.chunks import (
    CHUNK_TTL_MS,
    MANIFEST,
    ChunkedStore,
    chunk_key,
    encoding,
    plan,
)
from qrl.wire.codec import encode
from qrl.wire.weights import WEIGHTS, WeightStore

SMALL = 4096  # bytes a chunk holds in these tests: many chunks from small arrays


def arrays(v: float = 0.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a": rng.standard_normal((37, 29)).astype(np.float32) + v,
        "b": np.arange(1001, dtype=np.int64),
        "c": np.array(3.5, np.float64) + v,  # 0-d
        "d": np.zeros((0, 5), np.float32),  # empty
        "e": rng.standard_normal(3333).astype(np.float16),
        "f": np.array([True, False] * 7),
    }


def store(r, keys, **kw) -> ChunkedStore:
    return ChunkedStore(r, keys, keys.weights, WEIGHTS, chunk=kw.pop("chunk", SMALL), **kw)


def chunk_keys(r, keys) -> list[bytes]:
    return sorted(r.keys(keys.weights + ":c:*"))


def test_plan_cuts_whole_elements_within_the_chunk():
    msg = {"params": arrays(), "meta": None}
    enc = encoding(WEIGHTS, msg, chunk=SMALL)
    sizes = [sum((b - a) * enc.parts[i].wire_size for i, a, b in c) for c in enc.pieces]
    assert len(sizes) > 3 and all(0 < n <= SMALL for n in sizes)
    total = sum(a.nbytes for a in msg["params"].values())
    assert sum(sizes) == total
    assert plan(enc.parts, SMALL) == enc.pieces  # the reader's plan is the writer's


def test_chunked_round_trip_is_exact_and_old_chunks_go(r, keys):
    s, reader = store(r, keys), store(r, keys)
    for v in (1, 2, 3, 4):
        assert s.publish({"params": arrays(v), "meta": {"v": v}}, v) == v
        version, msg = reader.read()
        assert version == v and msg["meta"] == {"v": v}
        for k, want in arrays(v).items():
            got = msg["params"][k]
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(got, want)
            assert got.flags.writeable
    # the chunks of versions 3 and 4 only: older ones deleted, the current ones last
    n = len(encoding(WEIGHTS, {"params": arrays()}, chunk=SMALL).pieces)
    assert len(chunk_keys(r, keys)) == 2 * n
    assert all(r.ttl(k) == -1 for k in chunk_keys(r, keys))


def test_small_weights_are_one_blob_inline(r, keys):
    """The hot path of a small network: no chunk keys, one HGET to check, one HMGET."""
    net = torch.nn.Linear(4, 2)
    WeightStore(r, keys).publish(net, 1)
    assert chunk_keys(r, keys) == [] and set(r.hkeys(keys.weights)) >= {b"version", b"blob"}
    twin = torch.nn.Linear(4, 2)
    assert WeightStore(r, keys).load_into(twin) == 1
    assert torch.equal(twin.weight, net.weight)


@pytest.mark.parametrize("wire, tol", [("bfloat16", 2**-8), ("float16", 2**-11)])
def test_narrow_wire_round_trip(r, keys, wire, tol):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))
    WeightStore(r, keys, wire=wire).publish(net, 1)
    got = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))
    assert WeightStore(r, keys).load_into(got) == 1
    for a, b in zip(net.state_dict().values(), got.state_dict().values(), strict=True):
        assert b.dtype == torch.float32
        assert torch.allclose(a, b, rtol=tol, atol=1e-7) and not torch.equal(a, b)
    # half the bytes of float32 on the wire (chunked too)
    s = store(r, keys, wire=wire)
    s.publish({"params": {"x": np.linspace(-3, 3, 5000, dtype=np.float32)}}, 2)
    _, msg = s.read()
    x = msg["params"]["x"]
    assert x.dtype == np.float32
    assert np.allclose(x, np.linspace(-3, 3, 5000, dtype=np.float32), rtol=tol, atol=0)
    assert sum(r.strlen(k) for k in chunk_keys(r, keys)) < 5000 * 4 * 0.6


def test_float16_wire_refuses_what_it_cannot_hold(r, keys):
    with pytest.raises(ValueError):
        store(r, keys, wire="float16").publish({"params": {"x": np.full(3, 1e6, np.float32)}}, 1)


def test_half_written_version_is_never_read(r, keys):
    s = store(r, keys)
    s.publish({"params": arrays(1)}, 1)
    enc = encoding(WEIGHTS, {"params": arrays(2)}, chunk=SMALL)
    for i, blob in enumerate(enc.chunks()):  # a writer that died before the switch
        r.set(chunk_key(keys.weights, enc.fields["token"], i), blob, px=CHUNK_TTL_MS)
    version, msg = store(r, keys).read()
    assert version == 1 and np.array_equal(msg["params"]["a"], arrays(1)["a"])
    orphans = [k for k in chunk_keys(r, keys) if enc.fields["token"].encode() in k]
    assert orphans and all(0 < r.pttl(k) <= CHUNK_TTL_MS for k in orphans)  # they expire


def test_switch_is_atomic_under_a_reader(r, keys):
    """Every array of version v filled with v: a reader reading while a writer publishes in
    a loop loads whole versions only (old chunks vanish under it: it reads again)."""
    shapes = {"w1": (300, 40), "w2": (5000,), "w3": (7, 7, 7)}

    def version_of(v: int) -> dict:
        return {"params": {k: np.full(s, v, np.float32) for k, s in shapes.items()}}

    writer, stop, seen, bad = store(r, keys), threading.Event(), [], []
    writer.publish(version_of(1), 1)

    def read() -> None:
        reader = store(r, keys)
        while not stop.is_set():
            got = reader.read(-1)
            if got is None:
                continue
            v, msg = got
            seen.append(v)
            if not all((a == v).all() for a in msg["params"].values()):
                bad.append(v)

    t = threading.Thread(target=read)
    t.start()
    for v in range(2, 120):
        writer.publish(version_of(v), v)
    stop.set()
    t.join()
    assert not bad and len(set(seen)) > 5
    assert r.xlen(keys.deadletter) == 0


def test_reader_of_a_version_superseded_twice_reads_the_new_one(r, keys):
    s, reader = store(r, keys), store(r, keys)
    s.publish({"params": arrays(1)}, 1)

    def two_more(manifest) -> None:
        if manifest.version == 1:
            s.publish({"params": arrays(2)}, 2)
            s.publish({"params": arrays(3)}, 3)

    version, msg = reader.read(accept=two_more)
    assert version == 3 and np.array_equal(msg["params"]["a"], arrays(3)["a"])


def _victim(r, keys) -> tuple[ChunkedStore, list[bytes]]:
    s = store(r, keys)
    s.publish({"params": arrays(1)}, 1)
    return s, chunk_keys(r, keys)


HOSTILE = {
    "wrong-type": lambda r, k, old: (r.delete(k), r.rpush(k, "x")),
    "truncated": lambda r, k, old: r.set(k, old[:-7]),
    "forged-same-length": lambda r, k, old: r.set(k, bytes(len(old))),
    "huge": lambda r, k, old: r.set(k, old + b"x" * (70 << 20)),
    "empty": lambda r, k, old: r.set(k, b""),
    "missing": lambda r, k, old: r.delete(k),
}


@pytest.mark.parametrize("how", HOSTILE)
def test_hostile_chunk_is_rejected_without_crash(r, keys, how):
    s, names = _victim(r, keys)
    HOSTILE[how](r, names[1], r.get(names[1]) or b"")
    reader = store(r, keys)
    assert reader.read() is None
    assert r.xlen(keys.deadletter) == 1 and int(r.hget(keys.stats, "rejected:weights")) == 1
    assert reader.read() is None and r.xlen(keys.deadletter) == 1  # rejected once
    if how != "huge":  # (its length tells even without the hash)
        assert not s.kept(every_s=0) or how == "forged-same-length"
    s.publish({"params": arrays(2)}, 2)  # the next version is read
    assert reader.read()[0] == 2


def test_kept_hashes_each_chunk_in_turn(r, keys):
    s, names = _victim(r, keys)
    assert s.kept(every_s=0)
    r.set(names[2], bytes(r.strlen(names[2])))  # forged, same length
    assert not all(s.kept(every_s=0) for _ in names)


def _manifest(**change) -> bytes:
    enc = encoding(WEIGHTS, {"params": arrays(1)}, chunk=SMALL)
    list(enc.chunks())
    enc.fields.update({"version": 5, **change})
    return encode(MANIFEST.kind, enc.fields)


FORGED = {
    "garbage": b"\x04\x22garbage",
    "huge-dims": _manifest(dims=[2**31] * 3 + [1001, 0, 5, 3333, 14]),
    "fewer-hashes": _manifest(hashes=[]),
    "wrong-dtype": _manifest(dtypes=["complex64"] * 6),
    "not-an-array-field": _manifest(fields=["meta"] * 6),
    "bad-token": _manifest(token="../x"),
    "short-inline": _manifest(inline=b"abc", lengths=[], hashes=[]),
    "another-version": _manifest(version=4),
}


@pytest.mark.parametrize("how", FORGED)
def test_forged_manifest_is_rejected(r, keys, how):
    store(r, keys).publish({"params": arrays(1)}, 1)
    r.hset(keys.weights, mapping={"version": 5, "blob": FORGED[how]})
    assert store(r, keys).read() is None
    assert r.xlen(keys.deadletter) == 1


def test_weights_that_do_not_fit_are_not_fetched(r, keys):
    WeightStore(r, keys).publish(torch.nn.Linear(4, 3), 1)
    assert WeightStore(r, keys).load_into(torch.nn.Linear(4, 2)) is None
    assert r.xlen(keys.deadletter) == 0  # not garbage: another model's


@pytest.mark.slow
def test_100m_parameters_round_trip(r, keys):
    """400 MB of float32 through Redis in chunks (each under the 64 MiB cap), exact."""
    torch.manual_seed(0)
    net = torch.nn.Linear(10_000, 10_000)  # 100,010,000 parameters
    assert WeightStore(r, keys).publish(net, 7) == 7
    assert len(chunk_keys(r, keys)) >= 24
    got = torch.nn.Linear(10_000, 10_000, device="meta").to_empty(device="cpu")
    assert WeightStore(r, keys).load_into(got) == 7
    assert torch.equal(got.weight, net.weight) and torch.equal(got.bias, net.bias)


def test_snapshot_over_64_mib_round_trips_through_redis_and_a_file(r, keys, tmp_path):
    """A PBT snapshot (network + Adam state: 108 MB) in Redis and in the learner's file."""
    from qrl.runtime.snapshot import SnapshotStore, capture, read_file

    net = torch.nn.Linear(3000, 3000)
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 3000)).sum().backward()
    opt.step()
    snap = capture(net, opt, 11)
    assert sum(a.nbytes for a in (*snap.model.values(), *snap.opt.values())) > 64 << 20
    store = SnapshotStore(r, keys)
    store.save(snap)
    path = tmp_path / "snapshot"
    store.to_file(path)
    for got in (store.fetch(), read_file(path)):
        assert got.updates == 11
        for k in (*snap.model, *snap.opt):
            mine = snap.model.get(k, snap.opt.get(k))
            assert np.array_equal(mine, got.model.get(k, got.opt.get(k)))
    path.write_bytes(path.read_bytes()[:-100])  # truncated: not one
    assert read_file(path) is None


def test_ps_state_over_64_mib_round_trips(r, keys):
    from qrl.ps import protocol

    n = 6_000_000  # params, Adam's two averages: 72 MB
    rng = np.random.default_rng(0)
    state = {
        "version": 3,
        "last_ids": {"0": "5-0"},
        "params": rng.standard_normal(n).astype(np.float32),
        "opt": {
            "exp_avg": rng.standard_normal(n).astype(np.float32),
            "exp_avg_sq": rng.random(n).astype(np.float32),
            "step": np.array(3.0, np.float32),
        },
        "loss": [0.5, 0.1, 3.0],
    }
    store = protocol.state_store(r, keys, n, 4)
    store.replace(state)
    store.replace(state)  # a second save: above the first
    version, got = protocol.state_store(r, keys, n, 4).read()
    assert version == 1 and got["version"] == 3 and got["last_ids"] == {"0": "5-0"}
    assert np.array_equal(got["params"], state["params"])
    assert all(np.array_equal(got["opt"][k], v) for k, v in state["opt"].items())


def test_chunked_weights_through_a_cluster(redis_cluster):
    """The chunks share the manifest's hash tag: one slot, the Lua switch legal on a Cluster,
    through a client of a node that does not hold the run."""
    from qrl.wire.connection import connect
    from qrl.wire.keys import RunKeys

    keys = RunKeys("chunked-cluster")
    net = torch.nn.Linear(3000, 2000)  # 24 MB: two chunks
    writer = WeightStore(connect(redis_cluster.urls[0]), keys)
    for v in (1, 2, 3):
        writer.publish(net, v)
    got = torch.nn.Linear(3000, 2000)
    assert WeightStore(connect(redis_cluster.urls[1]), keys).load_into(got) == 3
    assert torch.equal(got.weight, net.weight)
    assert writer.kept(every_s=0)


@pytest.mark.slow
def test_100m_parameters_through_a_cluster(redis_cluster):
    """400 MB of float32 published through one node's client and fetched through another's
    (the chunks on the manifest's slot, wherever that is), exact; the keys deleted after."""
    from qrl.wire.connection import connect
    from qrl.wire.keys import RunKeys

    keys = RunKeys("chunked-cluster-100m")
    torch.manual_seed(0)
    net = torch.nn.Linear(10_000, 10_000)  # 100,010,000 parameters
    writer, reader = connect(redis_cluster.urls[0]), connect(redis_cluster.urls[1])
    try:
        assert WeightStore(writer, keys).publish(net, 7) == 7
        got = torch.nn.Linear(10_000, 10_000, device="meta").to_empty(device="cpu")
        assert WeightStore(reader, keys).load_into(got) == 7
        assert torch.equal(got.weight, net.weight) and torch.equal(got.bias, net.bias)
    finally:
        for node in range(3):
            client = redis_cluster.client(node)
            for key in client.scan_iter(match=keys.pattern(), count=1000):
                client.delete(key)


@pytest.mark.parametrize("wire", ["native", "bfloat16"])
def test_a_runs_weights_wire_setting_reaches_its_learners_publication(r, keys, redis_server, wire):
    """``weights_wire``: a learner built for the run publishes as the config says, and a
    reader gets float32 back (exact natively, within bfloat16's precision narrowed)."""
    from qrl.algos.apex.config import ApexConfig
    from qrl.runtime.runs import create_run
    from tests.helpers import make_learner

    cfg = ApexConfig(learning_starts=10**9, weights_wire=wire)  # nothing to train on
    create_run(r, keys, "apex", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    try:
        lrn.publish()
        manifest = r.hgetall(keys.weights)
        assert manifest, "nothing published"
        w = WeightStore(r, keys).fetch()
        assert w is not None
        for name, theirs in lrn.net.state_dict().items():
            got = torch.from_numpy(np.asarray(w.params[name]))
            assert got.dtype == torch.float32
            if wire == "native":
                assert torch.equal(got, theirs)
            else:
                assert torch.allclose(got, theirs, rtol=2**-8, atol=1e-7)
        narrowed = [
            n
            for n, t in lrn.net.state_dict().items()
            if not torch.equal(torch.from_numpy(np.asarray(w.params[n])), t)
        ]
        assert bool(narrowed) == (wire == "bfloat16")
    finally:
        lrn.close(lambda: True)
