"""What one worker's credentials can do to the parameter server (A3C, Gorila), on a real
Redis: a worker's user writes its gradients and reads the blocks, never a block or a
server's saved state (Redis 7's read-only key patterns), and a joined worker's user (``qrl
run join``) writes its own gradient streams only; a restarted shard refuses a saved state
its own server could not have written; shard 0's checkpoint holds its own state only; and
one worker pushing as fast as it can, under whatever worker ids it claims, gets no more than
its share of what is applied."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from qrl.algos import ALGOS
from qrl.algos.a3c.builder import make_optimizer
from qrl.algos.a3c.config import A3CConfig
from qrl.jobs.acl import join_user, user_name
from qrl.ps import protocol
from qrl.ps.client import PSClient
from qrl.ps.server import SHARE_WINDOW, ParameterServer
from qrl.runtime.checkpoint import load_checkpoint
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import load_scripts
from qrl.wire.streams import FIELD
from tests.cli import qrl
from tests.helpers import redis7
from tests.test_acl import _create
from tests.test_ps import _block, _grad, _net, _send, _server, never

ADMIN = "admin-pw-for-ps-tests"


def _as(server: EmbeddedRedis, run: str, role: str, folder: Path) -> redis.Redis:
    password = (folder / role).read_text().strip()
    return redis.Redis(server.host, server.port, username=user_name(run, role), password=password)


@pytest.mark.parametrize(("algo", "role"), [("a3c", "worker"), ("gorila", "learner")])
def test_a_workers_user_cannot_write_the_blocks_or_a_servers_state(algo, role, tmp_path):
    run = f"ps-{algo}"
    shards = RunKeys(run).shards(2)
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        done = qrl(
            "run",
            "create",
            algo,
            "--run",
            run,
            "--acl",
            str(tmp_path),
            "--set",
            "ps_shards=2",
            env={**os.environ, "QRL_REDIS_URL": server.url, "QRL_REDIS_PASSWORD": ""},
        )
        assert done.returncode == 0, done.stderr
        worker = _as(server, run, role, tmp_path)
        ps = _as(server, run, "ps", tmp_path)
        for sk in shards:
            ps.hset(protocol.params(sk), mapping={"version": 1, "blob": b"b"})
            ps.set(protocol.state(sk), b"s")  # the servers write both
            state, params = protocol.state(sk), protocol.params(sk)
            refused = [
                ("SET", state, b"x"),
                ("DEL", state),
                ("GET", state),
                ("HSET", params, "version", 2**50),
                ("SET", params, b"x"),
                ("DEL", params),
                ("SET", f"{params}:c:0a:0", b"x"),  # its chunks: read only
                ("GET", f"{state}:c:0a:0"),  # the state's: not at all
                ("SET", f"{params}:x", b"x"),  # nothing beside the chunks
            ]
            for command in refused:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    worker.execute_command(*command)
                    pytest.fail(f"{command[:2]} was allowed")
            # what a worker does is allowed
            assert worker.hget(protocol.params(sk), "version") == b"1"
            assert worker.get(f"{params}:c:0a:0") is None
            worker.xadd(protocol.gradients(sk, 0), {FIELD: b"g"})


def _joined(server: EmbeddedRedis, run: str, role: str, n: int, folder: Path) -> redis.Redis:
    """A client as ``role`` ``n``'s own user (``qrl run join --id N``)."""
    done = qrl(
        "run",
        "join",
        run,
        role,
        "--acl",
        str(folder),
        "--id",
        str(n),
        env={**os.environ, "QRL_REDIS_URL": server.url, "QRL_REDIS_PASSWORD": ""},
    )
    assert done.returncode == 0, done.stderr
    password = (folder / f"{role}.{n}").read_text().strip()
    user = f"{run}.{role}.{n}"
    return redis.Redis(server.host, server.port, username=user, password=password)


@pytest.mark.slow  # two qrl commands
@pytest.mark.parametrize(("algo", "role"), [("a3c", "worker"), ("gorila", "learner")])
def test_a_joined_workers_user_writes_its_own_gradient_streams_only(algo, role, tmp_path):
    run = f"ps-own-{algo}"
    shards = RunKeys(run).shards(2)
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        done = _create(server, algo, run, tmp_path, "--set", "ps_shards=2")
        assert done.returncode == 0, done.stderr
        me = _joined(server, run, role, 1, tmp_path)
        for sk in shards:
            mine, other = protocol.gradients(sk, 1), protocol.gradients(sk, 0)
            me.xadd(mine, {FIELD: b"g"})  # its own, in every shard
            refused = [
                ("XADD", other, "*", FIELD, b"a gradient posing as worker 0's"),
                ("DEL", other),
                ("XRANGE", other, "-", "+"),
                ("XGROUP", "DESTROY", other, "qrl"),
                ("XADD", protocol.gradients(sk, 5), "*", FIELD, b"a worker it is not"),
            ]
            for command in refused:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    me.execute_command(*command)
                    pytest.fail(f"{command[:2]} was allowed")


def test_a_worker_claiming_other_ids_gets_no_more_than_its_share(tmp_path):
    """A joined worker's user (worker 1 of two) pushes as fast as the streams take, each
    gradient under another worker id (PSClient's ``worker``), while worker 0 pushes one a
    round: what is applied of its pushes stays within its share. (Before, the server counted
    the id a message claimed: ten ids took ten shares, and 7 of every 8 gradients applied
    were the attacker's.)"""
    keys, rounds = RunKeys("ps-claims"), 60
    cfg = A3CConfig(workers=2, ps_max_staleness=10**6)  # the default share: 1.5 / 2
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        load_scripts(admin)  # (what qrl run create does: the users may not)

        def joined(n: int) -> redis.Redis:  # qrl run join's user, made here: no CLI start-up
            user, _, path = join_user(admin, ALGOS["a3c"], keys, cfg, "worker", n, tmp_path)
            password = path.read_text().strip()
            return redis.Redis(server.host, server.port, username=user, password=password)

        ps = ParameterServer(admin, keys, cfg, 0, _net(cfg), make_optimizer, algo="a3c", workers=2)
        assert ps.start(never)
        ps.consumer.block_ms = 0  # (a step that finds nothing returns at once)
        attacker = joined(1)
        honest = PSClient(joined(0), keys, cfg, _net(cfg), 0)
        claims = [PSClient(attacker, keys, cfg, _net(cfg), w) for w in range(1, 10)]
        for client in (honest, *claims):
            assert client.pull()
            for p in client.flat.params:
                p.grad = torch.full_like(p, 1e-4)
        full = lambda: True  # noqa: E731 (a push that finds its stream full gives up)
        for _ in range(rounds):
            assert honest.push(1.0, never)
            for client in claims * 8:  # each gradient under the next id
                with contextlib.suppress(redis.exceptions.NoPermissionError):
                    client.push(1.0, full)
            seen = -1
            while seen != (seen := ps.updates + sum(ps.drops.values())):  # all applied/dropped
                ps.step(never)
        attackers = ps.updates - rounds  # every one of worker 0's went in
        assert sum(ps.drops.values()) == ps.drops["flood"]
        print("the attacker's applied:", attackers, "dropped as flood:", ps.drops["flood"])
        assert attackers <= 3 * rounds + math.ceil(0.75 * SHARE_WINDOW), (attackers, ps.drops)


@pytest.mark.parametrize(
    "hostile", ["probe", "negative square", "negative step count", "a worker without a stream"]
)
def test_a_restarted_shard_refuses_a_state_its_server_could_not_have_saved(r, keys, hostile):
    cfg = A3CConfig()
    ps = _server(r, keys, cfg)
    for i in range(3):
        _send(r, keys, cfg, _grad(ps, i), version=i)
    ps.step(never)
    assert ps.updates == 3
    s = ps.state()
    if hostile == "probe":  # the issue's: every parameter 1e30 (finite) at version 2^50
        s["params"], s["version"] = np.full(ps.length, 1e30, np.float32), 2**50
    elif hostile == "negative square":  # its square root would make the next step NaN
        s["opt"]["square_avg"] = np.full(ps.length, -1.0, np.float32)
    elif hostile == "negative step count":
        s["opt"]["step"] = np.array(-5.0, np.float32)
    else:  # a number no worker of the run may hold
        s["last_ids"] = {"99": "1-0"}
    ps.saved.replace(s)
    again = _server(r, keys, cfg)  # refused, dead-lettered: the initial parameters
    assert int(r.hget(keys.stats, "rejected") or 0) == 1
    assert again.updates == 4  # published above the block the run had (version 3)
    assert np.array_equal(_block(again), _block(_server(r, RunKeys(keys.run + "-b"), cfg)))
    _send(r, keys, cfg, _grad(ps, 9), version=4)  # and it learns on
    again.step(never)
    assert again.updates == 5 and np.isfinite(_block(again)).all()


def test_shard_0s_checkpoint_holds_its_own_state_only(r, keys, tmp_path):
    cfg = A3CConfig(ps_shards=2)
    path = tmp_path / "checkpoint.pt"
    shards = [_server(r, keys, cfg, k, checkpoint=path) for k in range(2)]
    for k, ps in enumerate(shards):
        _send(r, keys, cfg, _grad(ps, k), version=0, to=k)
        ps.step(never)
    s = shards[1].state()  # what another writer of shard 1's state might have put there
    s["params"] = np.full(shards[1].length, 1e3, np.float32)
    shards[1].saved.replace(s)
    shards[0].save()
    saved = load_checkpoint(path, "a3c", cfg)["extra"]["ps"]
    assert saved["shards"] == 2 and saved["states"][1] is None
    assert saved["states"][0]["version"] == 1
    assert np.array_equal(saved["states"][0]["params"].numpy(), _block(shards[0]))


def _pushed(r, keys, cfg: A3CConfig, order: list[int]) -> ParameterServer:
    """A server of a run with two workers that applied the gradients of ``order`` (worker
    ids, in the order pushed), all computed on version 0 (none is stale: no limit here)."""
    ps = ParameterServer(r, keys, cfg, 0, _net(cfg), make_optimizer, algo="a3c", workers=2)
    assert ps.start(never)
    for i, worker in enumerate(order):
        _send(r, keys, cfg, _grad(ps, i), version=0, worker=worker)
    for _ in range(len(order)):  # each step applies (or drops) and deletes up to ps_batch
        if not any(r.xlen(stream) for stream in ps.streams):
            break
        ps.step(never)
    return ps


def test_a_flooding_worker_gets_no_more_than_its_share_and_the_others_go_in(r, keys):
    cfg = A3CConfig(workers=2, ps_max_staleness=10**6)  # the default share: 1.5 / 2
    ps = _pushed(r, keys, cfg, [0, *[1] * 10] * 40)  # worker 1 pushes ten to worker 0's one
    flooded = 400 - ps.drops["flood"]
    assert ps.updates == 40 + flooded  # every one of worker 0's went in
    cap = math.ceil(0.75 * SHARE_WINDOW)
    assert flooded <= 3 * 40 + cap and ps.held[1] <= cap  # at most 3/4 of any 128 in a row
    assert ps.metrics()["flood"] == ps.drops["flood"] >= 400 - (3 * 40 + cap)


def test_a_worker_left_alone_is_not_held_back(r, keys):
    cfg = A3CConfig(workers=2, ps_max_staleness=10**6)
    ps = _pushed(r, keys, cfg, [1] * 300)  # worker 0 stopped (or never came)
    assert ps.updates == 300 and ps.drops["flood"] == 0
