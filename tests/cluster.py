"""The tests' cluster: qrl's :class:`~qrl.server.embedded_cluster.EmbeddedCluster`, three nodes that
require a password with characters a URL must percent-encode (so the tests also cover qrl's
password path on a cluster)."""

from __future__ import annotations

import itertools

from qrl.server.embedded_cluster import SLOTS, ClusterUnsupported, EmbeddedCluster
from qrl.wire.keys import RunKeys

PASSWORD = "cluster-pw:#1"

__all__ = ["PASSWORD", "SLOTS", "ClusterUnsupported", "LocalCluster", "run_on"]


class LocalCluster(EmbeddedCluster):
    def __init__(self, nodes: int = 3, password: str | None = PASSWORD, **kwargs) -> None:
        super().__init__(nodes, password, **kwargs)


def run_on(cluster: EmbeddedCluster, node: int, prefix: str) -> RunKeys:
    """A fresh run whose keys live on ``node`` of ``cluster``."""
    for i in itertools.count():
        keys = RunKeys(f"{prefix}-{i}")
        if cluster.node_of(keys.config) == node:
            return keys
    raise AssertionError("unreachable")
