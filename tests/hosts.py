"""Machines emulated on this one: each host a network namespace of its own, all on one
bridge (in a namespace of its own too: nothing of this machine's own network is touched),
with a chosen bandwidth and a chosen round trip to Redis.

* Bandwidth: a token bucket (``tc qdisc ... tbf``) on both ends of each host's link.
* Latency: this kernel has no ``netem``, so Redis is reached through a delaying TCP relay
  (:mod:`tests._relay`) on the Redis host, which adds half the round trip each way. Every
  role talks to Redis only, so every path of a run pays it. :meth:`Hosts.ping_ms` measures
  what a client gets.
* Addresses: 10.213.N.0/24 with N random, only inside the namespaces made here; removed
  (namespaces, links, bridge and processes) on exit.

A :class:`Deployment` is a run's Redis on such hosts as a remote one would be: TLS, an admin
password, one ACL user per role (``qrl run create --acl``), roles started on the hosts as
those users, the admin's own connection through a Unix socket (no network).

Needs root and ``ip netns``; :func:`check_netns` says why not where they are missing."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.cli import qrl
from tests.helpers import wait_until
from tests.test_access import _tls_args, _tls_binary

ROOT = Path(__file__).resolve().parent.parent


def check_netns() -> str | None:
    """Why hosts cannot be emulated here (``None``: they can)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (ip netns)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "emulated hosts need iproute2 (ip, tc)"
    probe = f"qrl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Hosts:
    """``names`` hosts (the first is Redis's), each ``rate`` bits/s to the bridge (``None``:
    unlimited). Use as a context manager; :meth:`start` runs a command on a host."""

    def __init__(self, names: Sequence[str], rate: float | None = None) -> None:
        self.names = list(names)
        self.rate = rate
        self.tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
        self.net = f"10.213.{random.randrange(1, 255)}"
        self.procs: list[subprocess.Popen] = []

    def ns(self, host: str) -> str:
        return f"qrl{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{self.net}.{self.names.index(host) + 1}"

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self) -> None:
        switch = self.ns("switch")
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.names):
            ns, port = self.ns(host), f"p{i}"
            _ip("netns", "add", ns)
            # one veth pair per host: eth0 in the host, pI on the switch's bridge
            _ip(
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                switch,
            )
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate is not None:
                for where, dev in ((ns, "eth0"), (switch, port)):
                    self._limit(where, dev)

    def _limit(self, ns: str, dev: str) -> None:
        """A token bucket of ``rate`` on ``dev``'s egress (a burst of 1 ms of it, at least
        64 KiB; packets wait up to 50 ms before they are dropped)."""
        burst = max(int(self.rate / 8 / 1000), 65536)
        tc = ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(self.rate)}bit"]
        cmd = ["ip", "netns", "exec", ns, *tc, "burst", str(burst), "latency", "50ms"]
        subprocess.run(cmd, check=True, capture_output=True)

    def start(self, host: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """``argv`` run in ``host``'s namespace (stopped on exit)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **kw)
        self.procs.append(proc)
        return proc

    def python(self, host: str, args: Sequence[str], **kw) -> subprocess.Popen:
        """``python ARGS`` from the repository root on ``host``."""
        env = {**os.environ, **kw.pop("env", {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return self.start(host, [sys.executable, *args], cwd=ROOT, env=env, **kw)

    def relay(self, host: str, port: int, to: str, rtt_ms: float) -> subprocess.Popen:
        """A delaying relay on ``host``, listening on its address at ``port`` and forwarding
        to ``to`` (in its namespace) with ``rtt_ms`` / 2 added each way."""
        listen = f"{self.addr(host)}:{port}"
        args = ["-m", "tests._relay", "--listen", listen, "--to", to, "--delay-ms", str(rtt_ms / 2)]
        proc = self.python(host, args, stdout=subprocess.PIPE, text=True)
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the relay on {listen} did not start")
        return proc

    def ping_ms(self, host: str, url: str, n: int = 50) -> float:
        """The median round trip of a Redis PING from ``host`` to ``url``, in ms."""
        code = (
            "import statistics, sys, time\n"
            "from qrl.wire.connection import connect\n"
            "c = connect(sys.argv[1]); c.ping(); out = []\n"
            f"for _ in range({n}):\n"
            "    t = time.perf_counter(); c.ping(); out.append(time.perf_counter() - t)\n"
            "print(statistics.median(out) * 1000)\n"
        )
        proc = self.python(host, ["-c", code, url], stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=60)
        return float(out.strip())

    def __exit__(self, *exc: object) -> None:
        """Stop the processes, the last started first (roles before the Redis they finish
        with), then remove the namespaces and with them every link and address."""
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for host in [*self.names, "switch"]:
            subprocess.run(["ip", "netns", "del", self.ns(host)], capture_output=True)


HOSTS = ["redis", "learner", "actor0", "actor1"]  # Redis first, then the run's


@dataclass(frozen=True)
class Setup:
    """A run's algorithm, its ``qrl run create`` arguments, and its roles on the hosts of
    :data:`HOSTS`: (host, ACL role, ``qrl`` arguments); the actor-side ones once per actor
    host."""

    algo: str
    create: tuple[str, ...]
    central: tuple[tuple[str, str, tuple[str, ...]], ...]
    acting: tuple[str, tuple[str, ...]]


def _learner(algo: str) -> tuple[str, str, tuple[str, ...]]:
    return ("learner", "learner", ("learner", algo, "--device", "cpu"))


# the runs the network tests and benchmarks/network.py deploy, by name
SETUPS = {
    "apex": Setup(
        "apex",
        (),
        (("learner", "replay", ("replay",)), _learner("apex")),
        ("actor", ("actor", "apex")),
    ),
    "impala": Setup("impala", (), (_learner("impala"),), ("actor", ("actor", "impala"))),
    "impala-central": Setup(
        "impala",
        ("--set", "inference=central"),
        (_learner("impala"), ("learner", "inference", ("inference", "impala", "--device", "cpu"))),
        ("stepper", ("stepper", "impala")),
    ),
    "a3c": Setup("a3c", (), (("learner", "ps", ("ps", "a3c")),), ("worker", ("worker", "a3c"))),
    "es": Setup("es", (), (("learner", "master", ("es", "master")),), ("worker", ("es", "worker"))),
}


TLS_PORT, RELAY_PORT = 6379, 6380  # on the Redis host: the server's, the relay's


@dataclass
class Deployment:
    """Redis on the ``redis`` host of ``hosts`` (TLS, an admin password) behind a relay
    adding ``rtt_ms``; ``ping_ms``: the round trip an actor host measured through it."""

    hosts: Hosts
    admin: redis.Redis
    admin_url: str
    password: str
    ca: Path
    secrets: Path
    ping_ms: float

    def create(self, algo: str, run: str, *args: str) -> None:
        """``qrl run create ALGO --acl``: the run and one ACL user per role."""
        env = {**os.environ, "QRL_REDIS_PASSWORD": self.password}
        acl = ["--run", run, "--acl", str(self.secrets), *args]
        made = qrl("run", "create", algo, "--redis", self.admin_url, *acl, env=env, timeout=120)
        if made.returncode != 0:
            raise RuntimeError(f"qrl run create failed: {made.stderr[-2000:]}")

    def role(self, run: str, host: str, role: str, args: Sequence[str], log: Path) -> None:
        """``qrl ARGS`` on ``host`` as the run's ``role`` user, over TLS through the relay;
        its output in ``log``."""
        where = f"{self.hosts.addr('redis')}:{RELAY_PORT}"
        env = {
            "QRL_RUN": run,
            "QRL_REDIS_URL": f"rediss://{run}.{role}@{where}/0?ssl_ca_certs={self.ca}",
            "QRL_REDIS_PASSWORD_FILE": str(self.secrets / role),
            "QRL_REDIS_PASSWORD": "",
        }
        out = log.open("w")
        self.hosts.python(host, ["-m", "qrl.cli", "-v", *args], env=env, stdout=out, stderr=out)

    def launch(self, setup: Setup, run: str, logs: Path, *args: str) -> None:
        """Create ``run`` of ``setup`` (with ``args`` for ``qrl run create``) and start its
        roles on the hosts of :data:`HOSTS`, each logging into ``logs``."""
        self.create(setup.algo, run, *setup.create, *args)
        for host, role, argv in setup.central:
            self.role(run, host, role, argv, logs / f"{role}.log")
        role, argv = setup.acting
        for i, host in enumerate(HOSTS[2:]):
            self.role(run, host, role, argv, logs / f"{role}{i}.log")


@contextlib.contextmanager
def deployment(
    tmp: Path, names: Sequence[str], rate: float | None, rtt_ms: float
) -> Iterator[Deployment]:
    """Hosts ``names`` (the first runs Redis) with a :class:`Deployment` on them."""
    binary = _tls_binary()
    with Hosts(names, rate=rate) as hosts:
        redis_host = names[0]
        args = list(_tls_args(tmp / "tls", f"IP:{hosts.addr(redis_host)}"))
        args[1] = str(TLS_PORT)  # its own namespace: any port is free
        password, sock = secrets.token_hex(16), tmp / "redis.sock"
        server = [binary, "--port", "0", "--bind", "127.0.0.1", "--unixsocket", str(sock)]
        server += ["--requirepass", password, "--save", "", "--appendonly", "no", *args]
        hosts.start(redis_host, server, stdout=subprocess.DEVNULL)
        admin = redis.Redis(unix_socket_path=str(sock), password=password)
        wait_until(lambda: sock.exists() and admin.ping(), "the Redis host's server", 30)
        hosts.relay(redis_host, RELAY_PORT, f"127.0.0.1:{TLS_PORT}", rtt_ms)
        ca = tmp / "tls" / "ca.crt"
        url = f"rediss://:{password}@{hosts.addr(redis_host)}:{RELAY_PORT}/0?ssl_ca_certs={ca}"
        ping = hosts.ping_ms(names[-1], url)
        yield Deployment(hosts, admin, f"unix://{sock}", password, ca, tmp / "acl", ping)
