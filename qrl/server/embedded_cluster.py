"""A local Redis Cluster: N ``redis-server --cluster-enabled yes`` children (own temporary
directories, no persistence), joined from Python the way ``redis-cli --cluster create ...
--cluster-replicas 0`` joins them (slots split evenly, one config epoch per node, CLUSTER
MEET), and stopped after. ``qrl redis --cluster N``, the tests and ``benchmarks/shards.py``
start one.

With a password, :attr:`EmbeddedCluster.urls` carry it, :attr:`EmbeddedCluster.addresses`
do not.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import quote

import redis
from redis.crc import key_slot

from qrl.server.embedded import EmbeddedRedis, find_redis_server, free_port, server_version

SLOTS = 16384


def _free_ports(host: str, n: int, bus_option: bool, used: set[int]) -> list[int]:
    """``n`` free ports, none in ``used`` (which they are added to, so that the next call
    cannot hand out one of them again: a port freed a moment ago is often the next one the
    kernel gives); without the bus-port option, ones whose port + 10000 is free and unused
    too (and is added)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port(host)
        bus = p + 10000
        if p in used or (not bus_option and (bus in used or not _is_free(host, bus))):
            continue
        ports.append(p)
        used.update((p,) if bus_option else (p, bus))
    return ports


def _is_free(host: str, port: int) -> bool:
    if port > 65535:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class ClusterUnsupported(RuntimeError):
    """This redis-server cannot run in cluster mode (the message says why)."""


class EmbeddedCluster:
    """``nodes`` cluster nodes on ``host``; ``with EmbeddedCluster() as c:`` or start()/stop()."""

    def __init__(
        self,
        nodes: int = 3,
        password: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: tuple[str, ...] = (),
        binary: str | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        """``args``: more redis-server options for every node. ``tls``: redis-server's
        certificate options (``--tls-cert-file ...``); with them each node also serves TLS
        on a port of its own (:attr:`tls_ports`), the cluster bus included. ``binary``: a
        redis-server other than qrl's choice (one built with TLS). ``port``: the first
        node's port (with ``tls``, its TLS port), the others on the ports after it
        (default: free ports)."""
        self.password = password
        extra = args
        binary = binary or find_redis_server()
        # Redis 7 takes the bus port as an option; before, it is always the port + 10000
        self.bus_option = server_version(binary) >= (7,)
        first = 0 if tls else port  # with TLS, ``port`` is the first node's TLS port
        used: set[int] = set()  # every port chosen so far (one chosen twice: a node fails)
        ports = (
            [first + i for i in range(nodes)]
            if first
            else _free_ports(host, nodes, self.bus_option, used)
        )
        used.update(ports)
        if self.bus_option:  # port + 10000 may be taken
            self.bus_ports = _free_ports(host, nodes, True, used)
        else:
            self.bus_ports = [p + 10000 for p in ports]
            used.update(self.bus_ports)
        self.tls_ports = (
            ([port + i for i in range(nodes)] if port else _free_ports(host, nodes, True, used))
            if tls
            else []
        )
        self.nodes = []
        for i, (node_port, bus) in enumerate(zip(ports, self.bus_ports, strict=True)):
            args = ["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"]
            args += ["--cluster-config-file", "nodes.conf"]  # in the node's own directory
            if self.bus_option:
                args += ["--cluster-port", str(bus)]
            if tls:
                args += ["--tls-port", str(self.tls_ports[i]), "--tls-cluster", "yes", *tls]
            self.nodes.append(
                EmbeddedRedis(
                    node_port, host, password=password, args=(*args, *extra), binary=binary
                )
            )

    @property
    def urls(self) -> list[str]:
        """Each node's URL, password included."""
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """The first node's URL: any node's URL reaches the whole cluster."""
        return self.urls[0]

    @property
    def addresses(self) -> list[str]:
        """Each node's URL without the password."""
        return [n.address for n in self.nodes]

    def url_with(self, password: str, node: int = 0) -> str:
        n = self.nodes[node]
        return f"redis://:{quote(password, safe='')}@{n.host}:{n.port}/0"

    def client(self, node: int) -> redis.Redis:
        """A plain (not cluster) client of one node: what that node alone holds."""
        n = self.nodes[node]
        return redis.Redis(host=n.host, port=n.port, password=self.password)

    def node_of(self, key: str) -> int:
        """Which node (index into :attr:`nodes`) holds ``key``: the slots are split evenly."""
        return min(key_slot(key.encode()) // (SLOTS // len(self.nodes)), len(self.nodes) - 1)

    def keys_per_node(self, pattern: str = "*") -> list[list[bytes]]:
        """The keys matching ``pattern`` that each node holds, in node order."""
        out = []
        for i in range(len(self.nodes)):
            with self.client(i) as c:
                out.append(sorted(c.scan_iter(match=pattern, count=1000)))
        return out

    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        try:
            for n in self.nodes:
                n.start()
        except RuntimeError as e:
            self.stop()
            raise ClusterUnsupported(f"redis-server did not start in cluster mode: {e}") from e
        try:
            self._join(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _join(self, timeout: float) -> None:
        clients = [self.client(i) for i in range(len(self.nodes))]
        try:
            info = clients[0].info("cluster")
            if not info.get("cluster_enabled"):
                raise ClusterUnsupported("redis-server ignored --cluster-enabled yes")
            share = SLOTS // len(clients)
            for i, c in enumerate(clients):
                last = SLOTS - 1 if i == len(clients) - 1 else (i + 1) * share - 1
                c.execute_command("CLUSTER ADDSLOTS", *range(i * share, last + 1))  # Redis 6 too
                c.execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
            for n, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
                bus_arg = (bus,) if self.bus_option else ()  # Redis 6: port + 10000, implied
                clients[0].execute_command("CLUSTER MEET", n.host, n.port, *bus_arg)
            deadline = time.monotonic() + timeout
            while not all(self._ready(c) for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster did not come up within {timeout:.0f}s")
                time.sleep(0.05)
        finally:
            for c in clients:
                c.close()

    def _ready(self, client: redis.Redis) -> bool:
        """This node says the cluster is ok and knows every node with its slots."""
        fields = client.execute_command("CLUSTER INFO")
        if isinstance(fields, bytes):  # no response callback: the raw text
            fields = dict(line.split(":", 1) for line in fields.decode().split() if ":" in line)
        return (
            fields.get("cluster_state") == "ok"
            and int(fields.get("cluster_known_nodes", 0)) == len(self.nodes)
            and int(fields.get("cluster_size", 0)) == len(self.nodes)
        )

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
