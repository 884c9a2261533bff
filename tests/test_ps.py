"""The parameter server (Gorila, A3C) on a real Redis: gradients applied one optimizer step
each and published with a version; K shards step exactly as one server; stale, future and
outlier-loss gradients dropped and counted; hostile entries never reach the parameters; a
restarted server resumes from Redis with its version and optimizer state and applies no
gradient twice."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from qrl.actors.a3c import PSWeights
from qrl.algos import ALGOS
from qrl.algos.a3c.builder import _policy_value_net, make_optimizer
from qrl.algos.a3c.config import A3CConfig
from qrl.ps import protocol
from qrl.ps.client import Flat, PSClient
from qrl.ps.server import ParameterServer
from qrl.rl.envspec import EnvSpec
from qrl.wire.codec import encode
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.streams import FIELD
from qrl.wire.weights import WeightStore
from tests.helpers import far_redis, wait_until

ENV = EnvSpec.of("CartPole-v1")


def never() -> bool:
    return False


def _net(cfg: A3CConfig) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    return _policy_value_net(cfg, ENV)


def _server(r, keys, cfg: A3CConfig, shard: int = 0, checkpoint=None) -> ParameterServer:
    ps = ParameterServer(
        r, keys, cfg, shard, _net(cfg), make_optimizer, algo="a3c", checkpoint=checkpoint
    )
    assert ps.start(never)
    return ps


def _send(
    r,
    keys,
    cfg,
    grad: np.ndarray,
    version: int,
    loss: float = 1.0,
    to: int = 0,
    worker: int = 0,
    **over,
) -> None:
    """A gradient for shard ``to``, pushed to worker ``worker``'s stream of it."""
    sk = protocol.shard_keys(keys, cfg.ps_shards, to)
    msg = {"shard": to, "version": version, "loss": loss, "grad": grad, **over}
    r.xadd(protocol.gradients(sk, worker), {FIELD: encode(protocol.GRADIENT, msg)})


def _grad(ps: ParameterServer, seed: int, scale: float = 0.001) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal(ps.length)).astype(np.float32)


def _block(ps: ParameterServer) -> np.ndarray:
    return ps.param.detach().numpy().copy()


def test_gradients_are_applied_one_step_each_and_published(r, keys):
    cfg = A3CConfig()
    ps = _server(r, keys, cfg)
    ref = torch.nn.Parameter(ps.param.detach().clone())
    opt = make_optimizer([ref], cfg)
    for i in range(3):
        g = _grad(ps, i)
        _send(r, keys, cfg, g, version=0)
        ref.grad = torch.from_numpy(g)
        opt.step()
    ps.step(never)
    assert ps.updates == 3 and ps.staleness == [0, 1, 2]
    assert torch.equal(ps.param.detach(), ref.detach())
    worker = PSClient(r, keys, cfg, _policy_value_net(cfg, ENV), worker=0)
    assert worker.pull() and worker.versions == [3]
    assert torch.equal(Flat(worker.net, 1).vector(), ref.detach())
    assert r.xlen(protocol.gradients(keys, 0)) == 0  # acknowledged and deleted


def test_a_worker_far_from_redis_pushes_and_pulls_off_its_path(r, keys, redis_server):
    """5 ms from Redis, a worker's gradient pushes and its pulls run on threads of their
    own (in line, a push and a pull per unroll cost an A3C worker about two thirds of its
    rate there); each gradient still carries the versions of the blocks it was computed on,
    and what a pull brought is loaded between two steps (:meth:`PSWeights.fresh`)."""
    cfg = A3CConfig()
    ps = _server(r, keys, cfg)
    with far_redis(redis_server.port, rtt_ms=5.0) as far:
        net = _policy_value_net(cfg, ENV)
        client = PSClient(far, keys, cfg, net, worker=0)
        weights = PSWeights(client, pull_every=1)
        assert weights.wait(never) and client.versions == [0]
        for p in net.parameters():
            p.grad = torch.full_like(p, 1e-3)
        for _ in range(4):  # the first in line (its time not yet known), the rest off it
            assert client.push(1.0, never)
        client.close()
        assert not client.sending.in_line and client.pushed == 4
        for _ in range(2):  # nothing new: the first look in line, the second on its thread
            weights.done()
        ps.step(never)
        assert ps.updates == 4 and ps.staleness == [0, 1, 2, 3]  # each computed on 0
        wait_until(lambda: weights.done() or client.versions == [4], "the pull of version 4")
        weights.close()
        assert not weights.looking.in_line
        assert torch.equal(Flat(net, 1).vector(), ps.param.detach())


def test_sharded_servers_step_exactly_as_one(r, keys):
    one, three = A3CConfig(), A3CConfig(ps_shards=3)
    single = _server(r, keys, one)
    shards = [_server(r, keys, three, k) for k in range(3)]
    workers = [PSClient(r, keys, c, _net(c), 0) for c in (one, three)]
    for w in workers:
        assert w.pull()
    for i in range(4):
        grads = torch.randn(single.length, generator=torch.Generator().manual_seed(i)) / 1000
        for w in workers:
            start = 0
            for p in w.flat.params:
                p.grad = grads[start : start + p.numel()].view_as(p).clone()
                start += p.numel()
            assert w.push(loss=1.0, should_stop=never)
        for ps in (single, *shards):
            ps.step(never)
        for w in workers:
            w.pull()
    assert [s.updates for s in shards] == [4, 4, 4] and workers[1].versions == [4, 4, 4]
    assert torch.equal(torch.cat([s.param.detach() for s in shards]), single.param.detach())
    assert torch.equal(workers[0].flat.vector(), workers[1].flat.vector())


def test_stale_future_and_outlier_gradients_are_dropped_and_counted(r, keys):
    cfg = A3CConfig(ps_max_staleness=2, ps_loss_sigmas=3.0)
    ps = _server(r, keys, cfg)
    rng = np.random.default_rng(0)
    for i in range(30):  # the loss statistics warm up
        _send(r, keys, cfg, _grad(ps, i), version=i, loss=1.0 + 0.01 * rng.standard_normal())
        ps.step(never)
    assert ps.updates == 30
    before = _block(ps)
    _send(r, keys, cfg, _grad(ps, 100), version=27)  # 3 behind
    _send(r, keys, cfg, _grad(ps, 101), version=31)  # not reached
    _send(r, keys, cfg, _grad(ps, 102), version=30, loss=50.0)  # far off the mean
    ps.step(never)
    assert ps.drops == {"stale": 1, "future": 1, "outlier": 1, "norm": 0, "flood": 0}
    assert ps.updates == 30 and np.array_equal(_block(ps), before)
    _send(r, keys, cfg, _grad(ps, 103), version=28)  # 2 behind: within the bound
    ps.step(never)
    assert ps.updates == 31
    m = ps.metrics()
    assert (m["stale"], m["future"], m["outlier"], m["staleness_max"]) == (1, 1, 1, 3)
    # the histogram: 30 + the outlier at lag 0, the stale one at 3 and the last at 2
    assert [m[k] for k in ("lag_0", "lag_1_3", "lag_4_15", "lag_16_up")] == [31, 2, 0, 0]


def test_hostile_gradients_never_reach_the_parameters(r, keys):
    cfg = A3CConfig(grad_clip=0.5)
    ps = _server(r, keys, cfg)
    before = _block(ps)
    n = ps.length
    bad = np.full(n, 0.001, np.float32)
    nan = bad.copy()
    nan[3] = np.nan
    hostile = [
        {"grad": nan},
        {"grad": bad, "loss": float("inf")},
        {"grad": bad[:-1]},
        {"grad": bad.reshape(1, n)},
        {"grad": np.zeros(n, np.int32)},
        {"grad": np.zeros(n, np.float64)},
        {"grad": bad, "version": -1},
        {"grad": bad, "shard": 1},  # another shard's
        {"grad": np.full(n, 1e6, np.float32)},  # finite, but longer than any clipped gradient
    ]
    for over in hostile:
        _send(r, keys, cfg, **{"version": 0, **over})
    stream = protocol.gradients(keys, 1)
    r.xadd(stream, {FIELD: b"\x00not a payload"})
    r.xadd(stream, {FIELD: b"x" * (8 << 20)})  # huge
    r.xadd(stream, {b"other": b"field"})
    for _ in range(3):
        ps.step(never)
    assert ps.updates == 0 and np.array_equal(_block(ps), before)
    assert ps.drops["norm"] == 1 and ps.rejected == 1
    assert ps.consumer.rejected >= 9
    assert int(r.hget(keys.stats, "rejected") or 0) >= 10
    _send(r, keys, cfg, _grad(ps, 0), version=0)  # and it serves on
    ps.step(never)
    assert ps.updates == 1


@pytest.mark.parametrize(
    "garbage",
    [b"not a state", "list", "wrong optimizer"],
)
def test_a_garbage_saved_state_is_dead_lettered_not_loaded(r, keys, garbage):
    cfg = A3CConfig()
    ps = _server(r, keys, cfg)
    key = protocol.state(keys)
    if garbage == "list":
        r.delete(key)
        r.rpush(key, b"x")
    elif garbage == "wrong optimizer":
        s = ps.state()
        s["opt"] = {"exp_avg": np.zeros(ps.length, np.float32)}
        ps.saved.replace(s)
    else:
        r.hset(key, mapping={"version": 1, "blob": garbage})
    again = _server(r, keys, cfg)
    assert again.updates == 0 and np.array_equal(_block(again), _block(ps))
    if garbage != "list":
        assert int(r.hget(keys.stats, "rejected") or 0) >= 1


def test_a_saved_state_claiming_entries_not_yet_made_does_not_freeze_the_server(r, keys):
    cfg = A3CConfig()
    ps = _server(r, keys, cfg)
    _send(r, keys, cfg, _grad(ps, 0), version=0)
    ps.step(never)
    s = ps.state()
    s["last_ids"] = {"0": "99999999999999-0"}  # a writer's: every entry to come would be skipped
    ps.saved.replace(s)
    again = _server(r, keys, cfg)
    assert again.updates == 1
    _send(r, keys, cfg, _grad(ps, 1), version=1)
    again.step(never)
    assert again.updates == 2 and again.replayed == 0


def test_a_restarted_server_resumes_its_version_and_optimizer_state_once(r, keys):
    cfg = A3CConfig()
    ps = _server(r, keys, cfg)
    for i in range(5):
        _send(r, keys, cfg, _grad(ps, i), version=i)
    ps.step(never)
    for i in range(5, 8):
        _send(r, keys, cfg, _grad(ps, i), version=5)
    entries = ps.consumer.read()
    for e in entries:
        ps.apply(e)
    ps.persist()  # ... and killed here: its state saved, the gradients not acknowledged
    assert ps.updates == 8
    again = _server(r, keys, cfg)
    assert again.updates == 8 and np.array_equal(_block(again), _block(ps))
    want = {k: v.numpy() for k, v in ps.opt.state[ps.param].items()}
    got = {k: v.numpy() for k, v in again.opt.state[again.param].items()}
    assert want.keys() == got.keys() == {"step", "square_avg"}
    for k in want:
        assert np.array_equal(want[k], got[k])
    again.step(never)  # it re-reads its pending gradients: applied already, skipped
    assert again.updates == 8 and again.replayed == 3
    _send(r, keys, cfg, _grad(ps, 9), version=8)
    again.step(never)
    assert again.updates == 9


def test_a_restarted_server_resumes_every_workers_stream_exactly(r, keys):
    """Killed after applying one gradient of each worker's stream (its state saved, nothing
    acknowledged) while worker 1's older gradients and worker 0's newer ones still wait: the
    restarted server skips what it applied of each stream and applies the rest, none twice
    and none skipped (one last entry for all the streams would skip worker 1's, older than
    worker 0's first)."""
    cfg = A3CConfig(ps_batch=2, ps_max_staleness=10**6)
    ps = _server(r, keys, cfg)
    for worker in (1, 0):
        for i in range(3):
            _send(r, keys, cfg, _grad(ps, 10 * worker + i), version=0, worker=worker)
    entries = ps.consumer.read()  # the first of each stream (in turns)
    assert sorted(ps.worker_of[e.stream] for e in entries) == [0, 1]
    for e in entries:
        ps.apply(e)
    ps.persist()  # ... and killed here
    again = _server(r, keys, cfg)
    assert again.updates == 2 and set(again.last_ids) == {0, 1}
    for _ in range(4):
        again.step(never)
    assert again.updates == 6 and again.replayed == 2
    assert not any(r.xlen(stream) for stream in again.streams)
    assert again.state()["last_ids"] == {
        str(w): r.xinfo_stream(protocol.gradients(keys, w))["last-generated-id"].decode()
        for w in (0, 1)
    }


def test_an_older_servers_saved_state_is_resumed(r, keys):
    """A state saved before the workers had a stream each (one ``last_id`` of the stream they
    shared, which no server reads now): resumed, as having applied nothing of theirs."""
    cfg = A3CConfig()
    ps = _server(r, keys, cfg)
    _send(r, keys, cfg, _grad(ps, 0), version=0)
    ps.step(never)
    s = ps.state()
    del s["last_ids"]
    s["last_id"] = "1700000000000-0"
    ps.saved.replace(s)
    again = _server(r, keys, cfg)
    assert again.updates == 1 and again.last_ids == {}
    assert np.array_equal(_block(again), _block(ps))
    _send(r, keys, cfg, _grad(ps, 1), version=1, worker=3)
    again.step(never)
    assert again.updates == 2 and again.last_ids.keys() == {3}


def test_the_checkpoint_restores_an_empty_redis(r, keys, tmp_path):
    cfg = A3CConfig(ps_shards=2)
    path = tmp_path / "checkpoint.pt"
    shards = [_server(r, keys, cfg, k, checkpoint=path) for k in range(2)]
    worker = PSClient(r, keys, cfg, _net(cfg), 0)
    assert worker.pull()
    for p in worker.flat.params:
        p.grad = torch.full_like(p, 0.001)
    for _ in range(3):
        worker.push(1.0, never)
    for s in shards:
        s.step(never)
    shards[0].save()
    for sk in (protocol.shard_keys(keys, 2, k) for k in range(2)):
        r.delete(protocol.state(sk), protocol.params(sk), protocol.gradients(sk, 0))
    back = [_server(r, keys, cfg, k, checkpoint=path) for k in range(2)]
    for old, new in zip(shards, back, strict=True):
        assert np.array_equal(_block(new), _block(old))
    # shard 0 resumes its own state; shard 1 (whose state shard 0 does not vouch for) takes
    # its block of the network with a fresh optimizer
    assert back[0].updates == shards[0].updates == 3
    avg = [s.opt.state[s.param]["square_avg"] for s in (shards[0], back[0])]
    assert torch.equal(*avg)
    assert back[1].updates == 0 and not back[1].opt.state


def test_shards_on_a_cluster_each_work_on_a_slot_of_their_own(redis_cluster):
    keys = RunKeys(f"ps-cluster-{time.time_ns()}")
    cfg = A3CConfig(ps_shards=3)
    shards = [protocol.shard_keys(keys, 3, k) for k in range(3)]
    assert len({redis_cluster.node_of(protocol.params(sk)) for sk in shards}) == 3  # 3 nodes
    servers = [_server(connect(redis_cluster.urls[k]), keys, cfg, k) for k in range(3)]
    worker = PSClient(connect(redis_cluster.urls[0]), keys, cfg, _net(cfg), 0)
    assert worker.pull()
    for p in worker.flat.params:
        p.grad = torch.full_like(p, 1e-4)
    for _ in range(3):
        assert worker.push(1.0, never)
    for s in servers:
        s.step(never)
    worker.pull()
    assert [s.updates for s in servers] == [3, 3, 3] == worker.versions
    client = connect(redis_cluster.urls[1])
    client.xadd(protocol.gradients(shards[2], 0), {FIELD: b"garbage"})  # dead-lettered there
    servers[2].step(never)
    assert int(client.hget(shards[2].stats, "rejected")) == 1
    servers[0].publish()
    assert WeightStore(client, keys).version() == 3  # the whole network: 3 gradients


def test_qrl_status_lists_each_shards_stream_of_each_worker(keys):
    a3c = ALGOS["a3c"].streams(keys, {"ps_shards": 2, "workers": 3})
    assert list(a3c) == [f"gradients:{k}:{w}" for k in range(2) for w in range(3)]
    assert a3c["gradients:1:2"] == protocol.gradients(protocol.shard_keys(keys, 2, 1), 2)
    gorila = ALGOS["gorila"].streams(keys, {"learners": 2, "ps_shards": "junk"})
    assert {"gradients:0:0", "gradients:0:1"} <= gorila.keys() and "gradients:1:0" not in gorila
