"""A real redis-server for the whole test session, on a free port (no mocks)."""

from __future__ import annotations

import itertools
import os

import pytest
import redis

from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys
from tests.cluster import ClusterUnsupported, LocalCluster
from tests.helpers import skip_or_fail

_runs = itertools.count()


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the session's cluster is a ``cluster`` test: marked here, where the
    fixture is; tests that start nodes of their own carry the marker themselves."""
    for item in items:
        if "redis_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis() as server:
        os.environ["QRL_REDIS_URL"] = server.url
        yield server


@pytest.fixture(scope="session")
def redis_cluster():
    """A three-node Redis Cluster (with a password) for the session: ``.urls`` (any one
    reaches the cluster), ``.url``, ``.addresses``, ``.password``, ``.client(i)`` and
    ``.keys_per_node(pattern)`` for one node's own keys. Skipped, with the reason, where
    redis-server cannot run in cluster mode (failed under CI=true)."""
    try:
        cluster = LocalCluster().start()
    except ClusterUnsupported as e:
        skip_or_fail(str(e))
    yield cluster
    cluster.stop()


@pytest.fixture
def r(redis_server) -> redis.Redis:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def keys(request, redis_server) -> RunKeys:
    """A fresh run name per test, so tests never see each other's keys; in the session's
    Redis (its URL is then in QRL_REDIS_URL), never one that happens to listen on 6379."""
    return RunKeys(f"t{next(_runs)}-{request.node.name[:40].replace('[', '-').strip(']')}")
