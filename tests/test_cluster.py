"""qrl on a real three-node Redis Cluster (the ``redis_cluster`` fixture, tests/cluster.py)."""

from __future__ import annotations

import pytest
import redis


def test_fixture_is_a_cluster_of_three_masters_with_a_password(redis_cluster):
    assert len(redis_cluster.urls) == 3
    with redis_cluster.client(1) as node:
        assert node.info("cluster")["cluster_enabled"] == 1
        assert node.execute_command("CLUSTER INFO")["cluster_state"] == "ok"
        masters = [n for n in node.cluster("NODES").values() if "master" in n["flags"]]
        assert len(masters) == 3
    with (
        redis.Redis.from_url(redis_cluster.addresses[0]) as bare,
        pytest.raises(redis.AuthenticationError),
    ):
        bare.ping()
