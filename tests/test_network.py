"""Runs across emulated machines (:mod:`tests.hosts`): Redis on one host, the learner on
another, an actor on each of two more, 5 ms round trip to Redis and 1 Gbit/s links; every
role connects as a remote deployment would, over TLS and as its own ACL user. Each run must
solve CartPole (its published weights reach the target, confirmed on 100 fresh episodes, as
``qrl train`` confirms)."""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from qrl.algos import ALGOS
from qrl.jobs.train import Evaluator
from qrl.runtime.runs import load_run_config
from qrl.wire.keys import RunKeys
from tests.cli import qrl
from tests.helpers import not_none, skip_or_fail, wait_until
from tests.hosts import Hosts, check_netns
from tests.test_access import _tls_args, _tls_binary

pytestmark = pytest.mark.network

RTT_MS = 5.0
RATE = 1e9  # bits/s on every host's link
TLS_PORT, RELAY_PORT = 6379, 6380
TARGET, CONFIRM = 475.0, 100


@dataclass
class Cluster:
    """Redis (TLS, an admin password) on the ``redis`` host behind a relay adding the round
    trip; the test's own admin connection through a Unix socket (no network)."""

    hosts: Hosts
    admin: redis.Redis
    admin_url: str
    password: str
    ca: Path
    secrets: Path

    def role_url(self, run: str, role: str) -> str:
        where = f"{self.hosts.addr('redis')}:{RELAY_PORT}"
        return f"rediss://{run}.{role}@{where}/0?ssl_ca_certs={self.ca}"


@pytest.fixture
def cluster(tmp_path):
    why = check_netns()
    if why:
        skip_or_fail(why)
    binary = _tls_binary()
    with Hosts(["redis", "learner", "actor0", "actor1"], rate=RATE) as hosts:
        args = list(_tls_args(tmp_path / "tls", f"IP:{hosts.addr('redis')}"))
        args[1] = str(TLS_PORT)  # its own namespace: any port is free
        password, sock = secrets.token_hex(16), tmp_path / "redis.sock"
        server = [binary, "--port", "0", "--bind", "127.0.0.1", "--unixsocket", str(sock)]
        server += ["--requirepass", password, "--save", "", "--appendonly", "no", *args]
        hosts.start("redis", server, stdout=subprocess.DEVNULL)
        admin = redis.Redis(unix_socket_path=str(sock), password=password)
        wait_until(lambda: sock.exists() and admin.ping(), "the Redis host's server", 30)
        hosts.relay("redis", RELAY_PORT, f"127.0.0.1:{TLS_PORT}", RTT_MS)
        url = f"rediss://:{password}@{hosts.addr('redis')}:{RELAY_PORT}/0?ssl_ca_certs="
        rtt = hosts.ping_ms("actor0", url + str(tmp_path / "tls" / "ca.crt"))
        print(f"PING round trip from an actor host: {rtt:.2f} ms (asked for {RTT_MS})")
        yield Cluster(
            hosts, admin, f"unix://{sock}", password, tmp_path / "tls" / "ca.crt", tmp_path / "acl"
        )


def _start(c: Cluster, run: str, host: str, role: str, *args: str, log: Path) -> None:
    env = {
        "QRL_RUN": run,
        "QRL_REDIS_URL": c.role_url(run, role),
        "QRL_REDIS_PASSWORD_FILE": str(c.secrets / role),
        "QRL_REDIS_PASSWORD": "",
    }
    out = log.open("w")
    c.hosts.python(host, ["-m", "qrl.cli", "-v", *args], env=env, stdout=out, stderr=out)


def _solved(c: Cluster, algo: str, run: str, logs: Path, budget_s: float) -> float:
    """Evaluate the run's published weights as ``qrl train`` does until they reach the
    target and a 100-episode confirmation holds; returns the confirmed mean."""
    keys = RunKeys(run)
    cfg = load_run_config(c.admin, keys, algo, ALGOS[algo].config)
    evaluator = Evaluator(ALGOS[algo], cfg, episodes=10)

    def confirmed() -> float | None:
        score = evaluator(c.admin, keys)
        if score is None or score < TARGET:
            return None
        mean = evaluator.confirm(CONFIRM)
        return mean if mean >= TARGET else None

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.iterdir()))

    what = f"{algo} solving CartPole"
    return wait_until(confirmed, what, budget_s, until=not_none, every=2.0, context=tails)


def _create(c: Cluster, algo: str, run: str) -> None:
    env = {**os.environ, "QRL_REDIS_PASSWORD": c.password}
    args = ["--run", run, "--env", "CartPole-v1", "--seed", "0", "--acl", str(c.secrets)]
    made = qrl("run", "create", algo, "--redis", c.admin_url, *args, env=env, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]


@pytest.mark.parametrize("algo", ["apex", "impala"])
def test_a_run_across_four_hosts_at_5ms_solves_cartpole(cluster, algo, tmp_path):
    run, logs = f"net-{algo}", tmp_path / "logs"
    logs.mkdir()
    _create(cluster, algo, run)
    learner = ["learner", algo, "--device", "cpu", "--run-dir", str(tmp_path / "run")]
    if algo == "apex":
        _start(cluster, run, "learner", "replay", "replay", log=logs / "replay.log")
    _start(cluster, run, "learner", "learner", *learner, log=logs / "learner.log")
    for i in range(2):
        _start(cluster, run, f"actor{i}", "actor", "actor", algo, log=logs / f"actor{i}.log")
    assert _solved(cluster, algo, run, logs, budget_s=240) >= TARGET
