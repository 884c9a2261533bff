"""The tests' cluster: qrl's :class:`~qrl.server.embedded_cluster.EmbeddedCluster`, three nodes that
require a password with characters a URL must percent-encode (so the tests also cover qrl's
password path on a cluster)."""

from __future__ import annotations

from qrl.server.embedded_cluster import SLOTS, ClusterUnsupported, EmbeddedCluster

PASSWORD = "cluster-pw:#1"

__all__ = ["PASSWORD", "SLOTS", "ClusterUnsupported", "LocalCluster"]


class LocalCluster(EmbeddedCluster):
    def __init__(self, nodes: int = 3, password: str | None = PASSWORD, **kwargs) -> None:
        super().__init__(nodes, password, **kwargs)
