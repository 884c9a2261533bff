"""Secrets: a Redis password never shows in a message, a log or ``ps``. URLs are redacted
however the password is written; passwords come from the environment or a file instead of
the command line; ``qrl redis`` refuses to listen beyond loopback without one. Real
redis-server, the real CLI."""

from __future__ import annotations

import os
import re
import signal
import tempfile
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from qrl.server.embedded import EmbeddedRedis, free_port
from qrl.wire.connection import RedisUnavailable, connect, redact
from tests.cli import qrl, qrl_redis

SECRET = "S3cr#t/pa?ss@w:rd"  # what a URL should percent-encode, and people do not


def _leaks(text: str, secret: str = SECRET) -> list[str]:
    """The pieces (3+ characters between URL delimiters) of ``secret`` found in ``text``."""
    pieces = [secret, *re.split(r"[#/?@]", secret)]
    return [p for p in pieces if len(p) >= 3 and p in text]


@pytest.mark.parametrize(
    "url",
    [
        f"redis://user:{SECRET}@host:6379/0",
        f"redis://:{SECRET}@host:6379/0",
        f"rediss://{SECRET}@host:6380/0?ssl_ca_certs=/ca.crt",
        f"unix://:{SECRET}@/run/redis.sock?db=0",
        f"redis://host:6379/0?db=0&password={SECRET}",
        "redis://user:S3cr%23t%2Fpa%3Fss%40w%3Ard@host:6379/0",
        f"redis://host:6379/0?ssl_password={SECRET}&ssl_ca_certs=/ca.crt",
    ],
)
def test_redact_hides_any_password(url):
    out = redact(url)
    assert not _leaks(out), out
    assert "S3cr" not in out and "***" in out
    assert out.startswith(url.split("://")[0] + "://")
    if "user:" in url:
        assert "user:***@" in out  # the user name helps; it is kept


def test_redact_keeps_urls_without_secrets():
    for url in ("redis://localhost:6379/0", "rediss://h:6380/0?ssl_ca_certs=/a/ca.crt"):
        assert redact(url) == url


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        # misread by the URL parser: pieces of the password become the host or the port
        (f"redis://user:{SECRET}@127.0.0.1:{{port}}/0", SECRET),
        ("redis://user:12345/x@127.0.0.1:{port}/0", "12345/x"),
        (f"redis://127.0.0.1:{{port}}/0?password={SECRET}", SECRET),
    ],
)
def test_connection_errors_do_not_show_the_password(url, secret):
    with pytest.raises(RedisUnavailable) as info:
        connect(url.format(port=free_port()), wait=0.5)
    msg = str(info.value)
    assert not _leaks(msg, secret), msg


def test_password_from_the_environment_or_a_file(tmp_path, monkeypatch):
    with EmbeddedRedis(password=SECRET) as server:
        monkeypatch.delenv("QRL_REDIS_PASSWORD", raising=False)
        monkeypatch.delenv("QRL_REDIS_PASSWORD_FILE", raising=False)
        with pytest.raises(RedisUnavailable):  # the URL has none, the environment neither
            connect(server.address)
        monkeypatch.setenv("QRL_REDIS_PASSWORD", SECRET)
        assert connect(server.address).ping()
        monkeypatch.delenv("QRL_REDIS_PASSWORD")
        secret_file = tmp_path / "redis-password"
        secret_file.write_text(SECRET + "\n")
        monkeypatch.setenv("QRL_REDIS_PASSWORD_FILE", str(secret_file))
        assert connect(server.address).ping()
        # the command line carries no secret: URL and run from the environment
        env = {**os.environ, "QRL_REDIS_URL": server.address}
        out = qrl("run", "create", "es", "--run", "pw-from-file", env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "Warning" not in out.stderr
        assert redis.Redis.from_url(server.url).exists("qrl:{pw-from-file}:config")
        # a password on the command line works, with a warning that `ps` shows it
        monkeypatch.delenv("QRL_REDIS_PASSWORD_FILE")
        env = {**os.environ, "QRL_REDIS_URL": ""}
        out = qrl("run", "list", "--redis", server.url, env=env, timeout=60)
        assert out.returncode == 0 and "pw-from-file" in out.stdout, out.stderr
        assert "visible to every user" in out.stderr and not _leaks(out.stderr)
        monkeypatch.setenv("QRL_REDIS_PASSWORD_FILE", str(tmp_path / "nope"))
        with pytest.raises(RedisUnavailable, match="cannot read the password file"):
            connect(server.address)


def _env_without_password(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QRL_REDIS_PASSWORD")}
    return {**env, **extra}


def test_qrl_redis_refuses_a_public_bind_without_a_password():
    out = qrl("redis", "--bind", "0.0.0.0", env=_env_without_password(), timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("Error: refusing to bind redis-server to 0.0.0.0 without a password")
    assert out.stdout == ""


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["env", "file"])
def test_qrl_redis_takes_its_password_from_the_environment_or_a_file(how, tmp_path):
    args = ["--bind", "0.0.0.0"]
    env = _env_without_password(QRL_REDIS_PASSWORD=SECRET)
    if how == "file":
        secret_file = tmp_path / "pw"
        secret_file.write_text(SECRET)
        args += ["--password-file", str(secret_file)]
        env = _env_without_password()
    proc, (url,), (server_pid,), banner = qrl_redis(*args, env=env)
    try:
        assert url.startswith("redis://0.0.0.0:") and not _leaks(url + banner)
        for pid in (proc.pid, server_pid):  # nothing secret in `ps`
            assert not _leaks(_cmdline(pid)), _cmdline(pid)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert redis.Redis(port=port, password=SECRET).ping()
        assert not list(Path(tempfile.gettempdir()).glob("qrl-redis-*.conf"))  # removed
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


@pytest.mark.slow
def test_qrl_train_shows_no_password(tmp_path):
    with EmbeddedRedis(password=SECRET) as server:
        url = f"redis://127.0.0.1:{server.port}/0?password={quote(SECRET, safe='')}"
        run_dir = tmp_path / "run"
        out = qrl(
            "train",
            "es",
            "--redis",
            url,
            "--run",
            "secret-run",
            "--run-dir",
            str(run_dir),
            "--max-time",
            "1",
            "--set",
            "workers=1",
            env=_env_without_password(),
            timeout=120,
        )
        assert out.returncode in (0, 1), out.stderr[-3000:]  # it ran
        assert "password=***" in out.stderr  # the URL it joined, redacted
        logs = "".join(p.read_text() for p in (run_dir / "logs").iterdir())
        for text in (out.stdout, out.stderr, logs):
            assert not _leaks(text) and not _leaks(text, quote(SECRET, safe="")), text[-3000:]
