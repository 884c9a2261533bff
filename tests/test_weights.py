import numpy as np
import pytest
import torch

from qrl.wire.weights import WeightStore, load_arrays, module_arrays


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_publish_and_fetch_with_version(r, keys):
    store = WeightStore(r, keys)
    assert store.version() == -1 and store.fetch() is None
    learner, actor = net(0), net(1)
    assert not same(learner, actor)
    store.publish(learner, version=1, meta={"step": 10})
    assert store.version() == 1
    assert store.load_into(actor) == 1
    assert same(learner, actor)
    assert store.load_into(actor, newer_than=1) is None  # nothing new: no fetch
    w = store.fetch()
    assert w.version == 1 and w.meta == {"step": 10}
    with torch.no_grad():
        learner[0].weight.add_(1.0)
    store.publish(module_arrays(learner), version=5)
    assert store.load_into(actor, newer_than=1) == 5 and same(learner, actor)
    actor(torch.zeros(1, 4)).sum().backward()  # loaded tensors are ordinary, writable


def test_versions_only_increase(r, keys):
    store = WeightStore(r, keys)
    assert store.publish(net(0), version=3) == 3
    for stale, stored in ((3, 4), (2, 5)):  # not newer: stored above the newest instead
        assert store.publish(net(1), version=stale) == stored
        assert store.version() == stored and store.fetch().version == stored


def test_corrupt_blob_is_dead_lettered_and_weights_kept(r, keys):
    store = WeightStore(r, keys)
    learner, actor = net(0), net(1)
    store.publish(learner, version=1)
    store.load_into(actor)
    r.hset(keys.weights, mapping={"version": 2, "blob": b"\x04\x22garbage"})
    assert store.load_into(actor, newer_than=1) is None
    assert same(learner, actor)
    assert r.xlen(keys.deadletter) == 1 and int(r.hget(keys.stats, "rejected:weights")) == 1
    assert store.load_into(actor, newer_than=1) is None  # the same bad version is not re-read
    assert r.xlen(keys.deadletter) == 1
    # a blob whose inner version disagrees with the key's is rejected too
    blob = r.hget(keys.weights, "blob")
    store.publish(learner, version=3)
    good = r.hget(keys.weights, "blob")
    r.hset(keys.weights, mapping={"version": 4, "blob": good})
    assert store.fetch(newer_than=3) is None and r.xlen(keys.deadletter) == 2
    assert blob != good


def test_non_finite_weights_are_rejected(r, keys):
    store = WeightStore(r, keys)
    bad = module_arrays(net(0))
    bad["0.weight"][0, 0] = np.nan
    store.publish(bad, version=1)
    assert store.fetch() is None
    assert b"NaN" in r.xrange(keys.deadletter)[0][1][b"reason"]


def test_load_checks_names_shapes_dtypes():
    m = net(0)
    arrays = module_arrays(m)
    with pytest.raises(ValueError, match="missing"):
        load_arrays(m, {k: v for k, v in arrays.items() if k != "0.bias"})
    with pytest.raises(ValueError, match="shape"):
        load_arrays(m, {**arrays, "0.bias": np.zeros(9, np.float32)})
    with pytest.raises(ValueError, match="dtype"):
        load_arrays(m, {**arrays, "0.bias": np.zeros(8, np.float64)})
    load_arrays(m, arrays)
