"""The learner group (qrl/learners/group.py): formed through a real Redis, real gloo groups in
spawned child processes (results come back through a multiprocessing queue, not Redis)."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import threading
import time

import pytest
import redis
import torch
import torch.distributed as dist
from torch import nn

from qrl.learners.group import _MAX_VALUE, GroupLost, LearnerGroup, RedisStore, _enter, _key
from qrl.wire.keys import RunKeys
from tests.helpers import skip_or_fail

CPU = torch.device("cpu")
_ctx = multiprocessing.get_context("spawn")


def _net(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return net, torch.optim.Adam(net.parameters(), lr=1e-2)


def _step(net, opt, x: torch.Tensor, group: LearnerGroup | None = None) -> None:
    opt.zero_grad()
    net(x).pow(2).mean().backward()
    if group is not None:
        group.all_reduce_mean_(group.grads(net.parameters()))
    opt.step()


def _plain(x):
    """``x`` with numpy arrays for tensors: torch sends a tensor through a multiprocessing
    queue as shared memory, which its sender must outlive; arrays go by value."""
    if isinstance(x, torch.Tensor):
        return x.detach().numpy().copy()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _tensors(x):
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return torch.from_numpy(x)
    if isinstance(x, dict):
        return {k: _tensors(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_tensors(v) for v in x)
    return x


def _join(url: str, run: str, world: int = 2) -> LearnerGroup:
    return LearnerGroup.join(redis.Redis.from_url(url), RunKeys(run), world, CPU, timeout_s=30)


def _train(url: str, run: str, out) -> None:
    """Average two tensors, then train a net (each rank its own seed and data) for a few steps
    on averaged gradients."""
    with contextlib.closing(_join(url, run)) as g:
        t = [torch.full((3,), float(g.rank)), torch.arange(4.0).reshape(2, 2) * (g.rank + 1)]
        secs = g.all_reduce_mean_(t)
        net, opt = _net(seed=10 + g.rank)
        g.sync(net, opt, 0)  # equal counts: rank 0's net
        data = torch.Generator().manual_seed(100 + g.rank)
        for _ in range(5):
            _step(net, opt, torch.randn(16, 4, generator=data), g)
        total, vote = g.sum(torch.tensor([g.rank + 1.0])), g.any(g.rank == 1)
        out.send(_plain((g.rank, t, secs, net.state_dict(), float(total), vote, g.leader)))


def _sync(url: str, run: str, out) -> None:
    """Rank 1 has trained 3 updates on its own, rank 0 is fresh: sync, then one common step."""
    with contextlib.closing(_join(url, run)) as g:
        net, opt = _net(seed=g.rank)
        updates = 0
        if g.rank == 1:
            for _ in range(3):
                _step(net, opt, torch.randn(8, 4))
            updates = 3
        n = g.sync(net, opt, updates)
        synced = {k: v.clone() for k, v in net.state_dict().items()}
        _step(net, opt, torch.ones(8, 4), g)
        out.send(_plain((g.rank, n, synced, net.state_dict(), opt.state_dict())))


def _threads() -> list[str]:
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]


def _close_after_optimizer(url: str, run: str, out) -> None:
    """Join, make an optimizer (as a learner does after joining), average once, close: the
    names of the gloo threads still running."""
    g = _join(url, run)
    _, opt = _net(seed=0)
    g.all_reduce_mean_([torch.ones(3)])
    g.close()
    out.send((g.rank, sorted(t for t in _threads() if "gloo" in t)))


def _die(url: str, run: str, out, go) -> None:
    """Both join; rank 1 waits to be killed, rank 0 then tries an all-reduce."""
    g = _join(url, run)
    out.send((g.rank, os.getpid()))
    if g.rank == 1:
        time.sleep(120)  # until killed: nothing else to do
        return
    go.wait(60)
    try:
        g.all_reduce_mean_([torch.ones(10)])
        out.send("no error")
    except GroupLost as e:
        out.send(str(e))
    g.close()


def _reduce_when_told(url: str, run: str, out, go) -> None:
    """Join, say (rank, pid), and once ``go`` is set average rank + 1 over the group."""
    client = redis.Redis.from_url(url)
    with contextlib.closing(LearnerGroup.join(client, RunKeys(run), 2, CPU, timeout_s=120)) as g:
        out.send((g.rank, os.getpid()))
        go.wait(60)
        t = torch.tensor([g.rank + 1.0])
        g.all_reduce_mean_([t])
        out.send(float(t))


def _listening_ports(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (its sockets' inodes in /proc/net/tcp*)."""
    fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    inodes = {link[8:-1] for link in fds if link.startswith("socket:[")}
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state, inode = (line.split()[i] for i in (1, 3, 9))
                if state == "0A" and inode in inodes:  # LISTEN
                    ports.append(int(local.rsplit(":", 1)[1], 16))
    return ports


def _stores_answering(ports: set[int]) -> list[int]:
    """Those of ``ports`` on which a torch TCPStore sets and gets a key for an intruder. A
    store answers in milliseconds; gloo's listener takes the connection and holds it
    unanswered for a minute (TCPStore's own timeout does not bound that read), so the ports
    are probed side by side and one with no answer within 10 s has no store (its probe's
    thread ends when gloo drops the connection)."""
    answers: dict[int, bool] = {}

    def probe(port: int) -> None:
        try:
            timeout = datetime.timedelta(seconds=3)
            store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
            store.set("intruder", "x")
            answers[port] = store.get("intruder") == b"x"
        except RuntimeError:  # DistStoreError, DistNetworkError: no store there
            answers[port] = False

    threads = [threading.Thread(target=probe, args=(port,), daemon=True) for port in ports]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return sorted(port for port, answered in list(answers.items()) if answered)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_no_party_but_the_learners_user_reaches_the_groups_rendezvous(tmp_path):
    """Issue 68, finding 11: rank 0 served a TCPStore that anyone who reached its port could
    set and get keys in. Now the store is the run's hash in Redis: the learners (as their
    own ACL user) form the group, an actor's user cannot join it or touch its store, and no
    port of a learner answers as a store (what listens is gloo's, for the collectives)."""
    if not os.path.isdir("/proc/self/fd"):
        skip_or_fail("no /proc/PID/fd to read a process's sockets from")
    from qrl.algos import ALGOS
    from qrl.jobs.acl import create_users, user_name
    from qrl.server.embedded import EmbeddedRedis
    from tests.helpers import redis7

    keys = RunKeys("group-acl")
    with EmbeddedRedis(password="group-admin-pw", binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        create_users(admin, ALGOS["ppo"], keys, tmp_path / "pw")

        def url(role: str) -> str:
            pw = (tmp_path / "pw" / role).read_text().strip()
            return f"redis://{user_name(keys.run, role)}:{pw}@127.0.0.1:{server.port}/0"

        go = _ctx.Event()
        pipes = [_ctx.Pipe(duplex=False) for _ in "ab"]
        procs = [
            _ctx.Process(
                target=_reduce_when_told, args=(url("learner"), keys.run, w, go), daemon=True
            )
            for _, w in pipes
        ]
        for p in procs:
            p.start()
        try:
            conns = [c for c, _ in pipes]
            pids = [pid for _, pid in _recv(conns)]
            ports = {port for pid in pids for port in _listening_ports(pid)}
            assert ports and _stores_answering(ports) == []
            gen = admin.get(_key(keys, "gen")).decode()  # (its keys expire 120 s on)
            assert admin.hlen(_key(keys, "store", gen)) > 0  # the rendezvous went through Redis
            actor = redis.Redis.from_url(url("actor"))
            for attempt in (
                lambda: LearnerGroup.join(actor, keys, 2, CPU, timeout_s=2),
                lambda: actor.hget(_key(keys, "store", gen), "0//cpu//0/0"),
                lambda: actor.hset(_key(keys, "store", gen), "0//cpu//0/0", "x"),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    attempt()
            go.set()
            assert _recv(conns) == [1.5, 1.5]  # the group still works
            _finish(procs)
        finally:
            for p in procs:
                p.kill()


def _pair(target, redis_server, keys, *args):
    """Two children running ``target``, each with its own pipe back (a killed child must not
    take a lock that the other needs with it, as a shared queue's is)."""
    pipes = [_ctx.Pipe(duplex=False) for _ in "ab"]
    procs = [
        _ctx.Process(target=target, args=(redis_server.url, keys.run, w, *args), daemon=True)
        for _, w in pipes
    ]
    for p in procs:
        p.start()
    return [r for r, _ in pipes], procs


def _recv(conns, timeout: float = 90) -> list:
    """One message from each of ``conns``."""
    deadline = time.monotonic() + timeout
    out = []
    for c in conns:
        came = c.poll(max(deadline - time.monotonic(), 0))
        assert came, "a learner sent nothing"
        out.append(c.recv())
    return out


def _finish(procs) -> None:
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]


def _results(conns) -> dict:
    return {res[0]: _tensors(res) for res in _recv(conns)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_learners_average_and_stay_identical(redis_server, r, keys):
    dead, _ = _enter(r, keys, 2, 30)  # a previous pool's generation: both joined, then died
    _enter(r, keys, 2, 30)
    r.hset(_key(keys, "store", dead), "0//cpu//0/0", "junk")  # a restarted pool must not join it
    conns, procs = _pair(_train, redis_server, keys)
    out = _results(conns)
    _finish(procs)
    assert set(out) == {0, 1}
    for rank in (0, 1):
        _, t, secs, _, total, vote, leader = out[rank]
        assert torch.equal(t[0], torch.full((3,), 0.5))
        assert torch.equal(t[1], torch.arange(4.0).reshape(2, 2) * 1.5)
        assert secs > 0 and total == 3.0 and vote is True and leader == (rank == 0)
    a, b = out[0][3], out[1][3]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first, _ = _net(seed=10)  # they trained: not rank 0's initial net any more
    assert not torch.equal(first.state_dict()["0.weight"], a["0.weight"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_close_stops_gloos_threads_after_an_optimizer_was_made(redis_server, keys):
    """A group still alive after close leaves gloo's workers to release tensors while the
    interpreter exits: that aborted a learner (SIGABRT) now and then (a CI run's pool test)."""
    if not os.path.isdir("/proc/self/task"):
        skip_or_fail("no /proc/PID/task to read thread names from")
    conns, procs = _pair(_close_after_optimizer, redis_server, keys)
    out = dict(_recv(conns))
    _finish(procs)
    assert out == {0: [], 1: []}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sync_takes_the_state_of_the_rank_with_most_updates(redis_server, keys):
    conns, procs = _pair(_sync, redis_server, keys)
    out = _results(conns)
    _finish(procs)
    (_, n0, synced0, net0, opt0), (_, n1, synced1, net1, opt1) = out[0], out[1]
    assert n0 == n1 == 3
    assert all(torch.equal(synced0[k], synced1[k]) for k in synced0)
    assert all(torch.equal(net0[k], net1[k]) for k in net0)
    assert opt0["param_groups"] == opt1["param_groups"]
    s0, s1 = opt0["state"], opt1["state"]
    assert s0.keys() == s1.keys() == set(range(4))
    for i in s0:
        assert s0[i].keys() == s1[i].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(s0[i][k], s1[i][k]) for k in s0[i])
        assert float(s0[i]["step"]) == 4  # rank 1's 3 updates and the common one


def test_world_of_one_needs_no_torch_distributed(r, keys):
    g = LearnerGroup.join(r, keys, 1, CPU)
    assert (g.rank, g.world, g.leader) == (0, 1, True)
    t = torch.arange(3.0)
    assert g.all_reduce_mean_([t]) == 0.0 and torch.equal(t, torch.arange(3.0))
    assert torch.equal(g.sum(t), t) and g.any(True) and not g.any(False)
    net, opt = _net(0)
    assert g.sync(net, opt, 7) == 7
    g.close()
    g.close()
    assert not dist.is_initialized() and r.keys(keys.pattern()) == []
    with pytest.raises(TypeError, match="grads"):
        g.all_reduce_mean_([None])
    net[0].weight.grad = torch.ones(8, 4)
    grads = g.grads(net.parameters())  # the others had none: zeros
    assert [float(t.abs().sum()) for t in grads] == [32.0, 0.0, 0.0, 0.0]


def test_join_starts_a_new_generation_when_full_or_garbage(r, keys):
    gen, rank = _enter(r, keys, 2, 30)
    assert rank == 0 and _enter(r, keys, 2, 30) == (gen, 1)
    new, rank = _enter(r, keys, 2, 30)  # the generation is full: a restarted pool
    assert new != gen and rank == 0
    other, rank = _enter(r, keys, 3, 30)  # another size: not joined
    assert other not in (gen, new) and rank == 0
    for junk in ("garbage", "0123456789abcdef.3" * 3):
        r.set(keys.key("learners:gen"), junk)
        assert _enter(r, keys, 3, 30)[1] == 0
    r.delete(keys.key("learners:gen"))
    r.rpush(keys.key("learners:gen"), "x")  # another type
    gen, _ = _enter(r, keys, 3, 30)
    r.set(_key(keys, "joined", gen), "1e9")  # a count that is no count
    assert _enter(r, keys, 3, 30)[1] == 0


def test_a_store_value_too_large_or_of_another_type_is_an_error_not_read_whole(r, keys):
    store = RedisStore(r, _key(keys, "store", "ab.2"), 30, 0.5)
    store.set("k", b"\x00\xffaddr")
    assert store.get("k") == b"\x00\xffaddr" and store.add("n", 2) == 2 and store.add("n", 1) == 3
    assert store.check(["k", "n"]) and not store.check(["k", "gone"]) and store.num_keys() == 2
    assert r.ttl(store.key) > 0 and store.delete_key("n") and store.num_keys() == 1
    r.hset(store.key, "big", b"x" * (_MAX_VALUE + 1))
    with pytest.raises(RuntimeError, match="over 1048576 bytes"):
        store.get("big")
    with pytest.raises(RuntimeError, match="not set within 0.5 s"):
        store.get("never")
    r.delete(store.key)
    r.rpush(store.key, "x")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        store.get("k")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_peer_makes_the_next_collective_raise_group_lost(redis_server, keys):
    go = _ctx.Event()
    conns, procs = _pair(_die, redis_server, keys, go)
    try:
        ranks = _recv(conns)
        killed = dict(ranks)[1]
        os.kill(killed, signal.SIGKILL)
        next(p for p in procs if p.pid == killed).join(30)  # gone before rank 0 reduces
        go.set()
        survivor = conns[[rank for rank, _ in ranks].index(0)]
        # the collective's own timeout is 300 s: an error within the 60 s is the peer's loss
        message = _recv([survivor], 60)[0]
    finally:
        for p in procs:
            p.join(30)
            p.kill()
    assert "learner rank 0 of 2" in message and "restart the learners" in message, message


def test_join_times_out_with_a_clear_message_and_leaves_nothing_to_join(r, keys):
    with pytest.raises(TimeoutError, match="did not form within 0.5 s: 1 of 2 learners joined"):
        LearnerGroup.join(r, keys, 2, CPU, timeout_s=0.5)
    assert not dist.is_initialized()
    left = [k.decode() for k in r.keys(keys.pattern())]
    assert left == [_key(keys, "gen")]  # the half-formed generation is gone: not joined
    assert _enter(r, keys, 2, 30)[1] == 0
    stops = iter([False, False, True])
    assert LearnerGroup.join(r, keys, 2, CPU, should_stop=lambda: next(stops)) is None


def test_the_group_binds_the_interface_of_the_address_it_gives_the_others() -> None:
    """gloo and NCCL are told the interface by name (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME):
    the one that holds the learner's address; an address this machine lacks is an error that
    names it, not a group that binds elsewhere."""
    import psutil

    from qrl.learners.group import interface_of

    loopback = interface_of("127.0.0.1")
    assert any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[loopback])
    with pytest.raises(ValueError, match="203.0.113.7"):
        interface_of("203.0.113.7")  # TEST-NET-3: no machine's own
