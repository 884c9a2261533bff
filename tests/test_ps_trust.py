"""What one worker's credentials can do to the parameter server (A3C, Gorila), on a real
Redis: a worker's user writes its gradients and reads the blocks, never a block or a
server's saved state (Redis 7's read-only key patterns); a restarted shard refuses a saved
state its own server could not have written; shard 0's checkpoint holds its own state only;
and one worker pushing as fast as it can gets no more than its share of what is applied."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from qrl.jobs.acl import user_name
from qrl.ps import protocol
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys
from qrl.wire.streams import FIELD
from tests.cli import qrl
from tests.helpers import redis_binaries, skip_or_fail

ADMIN = "admin-pw-for-ps-tests"


def _redis7() -> str:
    binary = redis_binaries().get((7,))
    if binary is None:
        skip_or_fail("needs Redis 7's read-only key patterns: no redis-server 7 on PATH")
    return binary


def _as(server: EmbeddedRedis, run: str, role: str, folder: Path) -> redis.Redis:
    password = (folder / role).read_text().strip()
    return redis.Redis(server.host, server.port, username=user_name(run, role), password=password)


@pytest.mark.parametrize(("algo", "role"), [("a3c", "worker"), ("gorila", "learner")])
def test_a_workers_user_cannot_write_the_blocks_or_a_servers_state(algo, role, tmp_path):
    run = f"ps-{algo}"
    shards = RunKeys(run).shards(2)
    with EmbeddedRedis(password=ADMIN, binary=_redis7()) as server:
        done = qrl(
            "run", "create", algo, "--run", run, "--acl", str(tmp_path), "--set", "ps_shards=2",
            env={**os.environ, "QRL_REDIS_URL": server.url, "QRL_REDIS_PASSWORD": ""},
        )  # fmt: skip
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
            ]
            for command in refused:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    worker.execute_command(*command)
                    pytest.fail(f"{command[:2]} was allowed")
            # what a worker does is allowed
            assert worker.hget(protocol.params(sk), "version") == b"1"
            worker.xadd(protocol.gradients(sk), {FIELD: b"g"})
