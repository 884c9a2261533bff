"""qrl on a real three-node Redis Cluster (the ``redis_cluster`` fixture, tests/cluster.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
from urllib.parse import quote

import numpy as np
import pytest
import redis

from qrl.replay.shards import ShardedReplay
from qrl.replay.store import PrioritizedReplay, RecordLayout
from qrl.runtime.ids import claim_id
from qrl.runtime.metrics import MetricsReader, report
from qrl.runtime.runs import delete_run
from qrl.runtime.status import collect
from qrl.server.embedded import server_version
from qrl.server.embedded_cluster import EmbeddedCluster
from qrl.wire.cluster import ClusterClient
from qrl.wire.codec import Field, Schema, encode
from qrl.wire.connection import RedisUnavailable, connect
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamConsumer, StreamProducer
from qrl.wire.weights import WeightStore
from tests.cli import qrl, qrl_redis
from tests.cluster import LocalCluster, run_on
from tests.helpers import pid_alive
from tests.test_access import _tls_args, _tls_binary

pytestmark = pytest.mark.cluster


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


def held(cluster, keys: RunKeys) -> list[int]:
    """How many keys of run ``keys`` each node holds."""
    return [len(k) for k in cluster.keys_per_node(keys.pattern())]


def test_any_node_url_gives_a_cluster_client_that_reaches_every_node(redis_cluster, redis_server):
    with connect(redis_server.url) as single:  # not a cluster node: a plain client
        assert type(single) is redis.Redis
    client = connect(redis_cluster.urls[1])
    assert isinstance(client, ClusterClient)
    runs = [run_on(redis_cluster, node, "reach") for node in range(3)]
    for keys in runs:
        client.set(keys.config, keys.run)  # MOVED from node 1 for two of them, followed
    assert [held(redis_cluster, keys) for keys in runs] == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    # SCAN walks every master, not the node of the URL alone
    found = {RunKeys.run_of(k) for k in client.scan_iter(match="qrl:{reach-*}:config")}
    assert found >= {keys.run for keys in runs}
    for keys in runs:
        assert delete_run(client, keys) == 1
    assert [held(redis_cluster, keys) for keys in runs] == [[0, 0, 0]] * 3
    client.close()


@pytest.mark.slow
def test_run_commands_through_one_node_see_every_node(redis_cluster, tmp_path):
    runs = [run_on(redis_cluster, node, "cli") for node in range(3)]
    for keys, url in zip(runs, redis_cluster.urls[::-1], strict=True):
        made = qrl("run", "create", "apex", "--run", keys.run, "--redis", url, timeout=60)
        assert made.returncode == 0, made.stderr
    assert [held(redis_cluster, keys) for keys in runs] == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    with connect(redis_cluster.urls[2]) as client:  # more keys than the config to delete
        for keys in runs:
            report(client, keys, "actor", 0, steps=5)
    url = redis_cluster.urls[0]
    listed = qrl("run", "list", "--json", "--redis", url, timeout=60)
    assert listed.returncode == 0, listed.stderr
    by_name = {r["run"]: r for r in json.loads(listed.stdout)}
    assert {keys.run for keys in runs} <= by_name.keys()
    assert {by_name[keys.run]["algo"] for keys in runs} == {"apex"}

    for keys in runs:
        shown = qrl("status", "--run", keys.run, "--json", "--redis", url, timeout=60)
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        assert status["run"] == keys.run and status["algo"] == "apex"
        assert [(p["role"], p["values"]["steps"]) for p in status["processes"]] == [("actor", 5)]
    unnamed = qrl("status", "--redis", url, timeout=60)  # several runs: it names them all
    assert unnamed.returncode == 2 and all(keys.run in unnamed.stderr for keys in runs)

    for keys in runs:
        assert held(redis_cluster, keys) == [
            3 if n == redis_cluster.node_of(keys.config) else 0 for n in range(3)
        ]  # config, metrics, heartbeat
        gone = qrl("run", "delete", keys.run, "--yes", "--redis", url, timeout=60)
        assert gone.returncode == 0, gone.stderr
        assert held(redis_cluster, keys) == [0, 0, 0]
    left = json.loads(qrl("run", "list", "--json", "--redis", url, timeout=60).stdout)
    assert not {r["run"] for r in left} & {keys.run for keys in runs}


ITEM = Schema("item", {"seq": Field(int), "x": Field(np.ndarray, dtypes=("float32",))})


def test_streams_weights_leases_metrics_and_replay_through_a_cluster_client(redis_cluster):
    keys = run_on(redis_cluster, 2, "data")
    client = connect(redis_cluster.urls[0])  # not the node that holds the run

    producer = StreamProducer(client, keys.experience, maxlen=100, keys=keys)
    for i in range(5):
        producer.add(encode("item", {"seq": i, "x": np.full(3, i, np.float32)}))
    client.xadd(keys.experience, {"d": b"not msgpack"})  # dead-lettered in a transaction
    consumer = StreamConsumer(client, keys, keys.experience, ITEM, count=16, block_ms=10)
    got = consumer.read()
    assert [e.data["seq"] for e in got] == list(range(5))
    consumer.ack(got)  # XACK + XDEL in one transaction
    assert client.xlen(keys.experience) == 0 and client.xlen(keys.deadletter) == 1
    assert client.hget(keys.stats, "produced:experience") == b"5"
    consumer.close()

    store = WeightStore(client, keys)
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    assert store.publish(params, version=3) == 3
    fetched = WeightStore(connect(redis_cluster.urls[1]), keys).fetch()
    assert fetched.version == 3
    np.testing.assert_array_equal(fetched.params["w"], params["w"])

    first, second = claim_id(client, keys, "actor", 2), claim_id(client, keys, "actor", 2)
    assert (first.ident, second.ident) == (0, 1)
    first.release()
    again = claim_id(client, keys, "actor", 2)
    assert again.ident == 0
    for lease in (second, again):  # else their keeper threads outlive this cluster
        lease.release()

    report(client, keys, "learner", 0, updates=7)
    reader = MetricsReader(client, keys, [("learner", 0)], from_start=True)
    assert [m["values"]["updates"] for m in reader.read()] == [7]
    status = collect(client, keys)
    assert [p["role"] for p in status["processes"]] == ["learner"]

    layout = RecordLayout((4,), "float32")
    ids = np.arange(50)
    obs = ids[:, None] * np.ones(4, np.float32)
    records = layout.pack(obs, ids, ids * 0.5, np.ones(50), obs)
    for mode in ("rank", "proportional"):
        replay = PrioritizedReplay(client, keys, layout, 40, mode=mode, seed=1)
        assert replay.insert(records, np.linspace(0.1, 2.0, 50), batch_id=mode) == 10
        assert replay.insert(records, np.ones(50), batch_id=mode) == -1  # seen: skipped
        sample = replay.sample(16)
        assert len(sample.ids) == 16 and set(sample.batch["action"]) <= set(range(10, 50))
        np.testing.assert_array_equal(sample.batch["obs"][:, 0], sample.batch["action"])
        replay.update_priorities(sample.ids, np.full(16, 3.0))
        delete_run(client, keys)
    # three shards on three hash tags: one cluster pipeline sends each node its updates
    sharded = ShardedReplay(client, keys, layout, 60, shards=3, seed=1)
    for s, part in enumerate(sharded.parts):
        part.insert(records[s * 10 : s * 10 + 10], np.ones(10), batch_id=f"b{s}")
    sample = sharded.sample(24)
    sharded.update_priorities(sample.ids, np.full(24, 3.0))
    for i in sample.ids:
        s, local = i.split(b":")
        assert client.zscore(sharded.parts[int(s)].keys.replay_priorities, local) == 3.0
    delete_run(client, keys)
    assert held(redis_cluster, keys) == [0, 0, 0]
    client.close()


def test_password_from_the_environment_and_database_zero_only(redis_cluster, monkeypatch):
    address = redis_cluster.addresses[1]
    monkeypatch.setenv("QRL_REDIS_PASSWORD", redis_cluster.password)
    with connect(address) as client:
        assert isinstance(client, ClusterClient) and client.ping()
    monkeypatch.setenv("QRL_REDIS_PASSWORD", "wrong")
    with pytest.raises(RedisUnavailable, match="cannot reach"):
        connect(address)
    monkeypatch.setenv("QRL_REDIS_PASSWORD", redis_cluster.password)
    other_db = redis_cluster.addresses[2].removesuffix("/0") + "/3"
    with pytest.raises(RedisUnavailable, match="only database 0"):
        connect(other_db)
    out = qrl("run", "list", "--redis", other_db, timeout=60)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("Error: ") and "only database 0: end the URL with /0" in out.stderr


@pytest.mark.slow
def test_train_apex_solves_cartpole_on_a_cluster(redis_cluster, tmp_path):
    keys = run_on(redis_cluster, 2, "train")
    env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_URL"}
    env["QRL_REDIS_PASSWORD"] = redis_cluster.password  # the URL without it: no ps warning
    run_dir = tmp_path / "run"
    args = (
        "--env",
        "CartPole-v1",
        "--run",
        keys.run,
        "--run-dir",
        str(run_dir),
        "--max-time",
        "150",
    )
    out = qrl("train", "apex", *args, "--redis", redis_cluster.addresses[0], env=env, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    # Ape-X's first greedy weights sometimes score 500 already, before the learner's first
    # report: the run's experience on the cluster is what this checks (held below)
    assert result["reached"] and result["env_steps"] > 0
    on_nodes = held(redis_cluster, keys)  # one run, one hash tag: one node
    assert on_nodes[2] >= 5 and on_nodes[:2] == [0, 0], on_nodes
    logs = (run_dir / "logs" / "learner.log").read_text()
    assert "Traceback" not in logs and "MovedError" not in logs
    with connect(redis_cluster.urls[1]) as client:
        delete_run(client, keys)


@pytest.mark.slow
def test_a_stalled_node_is_waited_for_until_the_deadline():
    """A node that stops answering (SIGSTOP) is retried with backoff, commands and whole
    transactions alike, as on a single Redis; past the deadline: RedisUnavailable."""
    with LocalCluster(password=None) as cluster:
        keys = run_on(cluster, 1, "stall")
        pid = cluster.nodes[1].proc.pid
        client = connect(cluster.urls[0], deadline=30, socket_timeout=0.5)
        client.set(keys.config, b"x")
        os.kill(pid, signal.SIGSTOP)
        resumed = threading.Event()

        def resume() -> None:
            resumed.set()  # before SIGCONT: a command answered after it finds it set
            os.kill(pid, signal.SIGCONT)

        threading.Timer(2.0, resume).start()
        pipe = client.pipeline(transaction=True)  # retried whole (idempotent, as qrl's are)
        pipe.hset(keys.stats, "n", 7)
        pipe.hget(keys.stats, "n")
        assert pipe.execute()[1] == b"7"
        assert resumed.is_set()  # it was answered only once the node went on: it waited
        assert client.get(keys.config) == b"x"
        short = connect(cluster.urls[2], deadline=1.5, socket_timeout=0.5)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(RedisUnavailable, match="has not answered for 2s"):
                short.get(keys.config)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert client.hget(keys.stats, "n") == b"7"


def test_an_acl_user_limited_to_its_run_gets_the_cluster(redis_cluster):
    """The per-run rule (docs/many-machines.md) for a run's user (no @dangerous, so no INFO)
    is enough: cluster mode is found with CLUSTER INFO, the slot map read with CLUSTER
    SLOTS."""
    keys, other = run_on(redis_cluster, 0, "acl"), run_on(redis_cluster, 1, "acl-other")
    rule = f"on >runner-pw resetkeys ~{keys.prefix}* +@all -@admin -@dangerous".split()
    if server_version(redis_cluster.nodes[0].binary) < (7,):
        rule += ["+cluster|info", "+cluster|slots"]  # Redis 6: CLUSTER is @admin as a whole
    for node in range(3):  # ACLs are per node
        with redis_cluster.client(node) as c:
            c.execute_command("ACL SETUSER", "runner", *rule)
    host_port = redis_cluster.addresses[2].removeprefix("redis://")
    client = connect(f"redis://runner:runner-pw@{host_port}")
    assert isinstance(client, ClusterClient)
    store = WeightStore(client, keys)
    assert store.publish({"w": np.ones(2, np.float32)}, version=0) == 0
    assert store.fetch().version == 0
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set(other.config, b"x")
    delete_run(client, keys)
    client.close()


@pytest.mark.slow
def test_a_cluster_over_tls_checks_every_node_certificate(tmp_path):
    binary = _tls_binary()
    certs = _tls_args(tmp_path / "tls", "IP:127.0.0.1,DNS:localhost")[2:]  # not the port
    with LocalCluster(tls=certs, binary=binary) as cluster:
        ca = f"ssl_ca_certs={tmp_path / 'tls' / 'ca.crt'}"
        pw = quote(cluster.password, safe="")
        url = f"rediss://:{pw}@127.0.0.1:{cluster.tls_ports[1]}/0?{ca}"
        client = connect(url)
        assert isinstance(client, ClusterClient)
        runs = [run_on(cluster, node, "tls") for node in range(3)]
        for keys in runs:  # each node reached over TLS, its certificate checked
            client.set(keys.config, keys.run)
            assert client.get(keys.config) == keys.run.encode()
        for node in client.get_nodes():
            kwargs = node.redis_connection.connection_pool.connection_kwargs
            assert node.port in cluster.tls_ports and kwargs["ssl_check_hostname"] is True
        assert sorted(map(len, cluster.keys_per_node("qrl:{tls-*"))) == [1, 1, 1]
        client.close()
        with pytest.raises(RedisUnavailable, match="cannot reach"):  # without the CA
            connect(f"rediss://:{pw}@127.0.0.1:{cluster.tls_ports[0]}/0")


def test_a_clusters_ports_are_all_distinct(tmp_path):
    """Every node's port, bus port and TLS port is its own: chosen one by one, a port the
    kernel handed out a moment before came back about once in 400 clusters of 3 TLS nodes,
    and the second node on it failed to start (a CI run, 2026-12-06)."""
    binary = _tls_binary()
    certs = ("--tls-cert-file", "x", "--tls-key-file", "x")  # (nothing starts here)
    for _ in range(1000):
        c = EmbeddedCluster(3, tls=certs, binary=binary)
        chosen = [n.port for n in c.nodes] + c.bus_ports + c.tls_ports
        assert len(set(chosen)) == 9, chosen


@pytest.mark.slow
def test_qrl_redis_cluster_starts_a_local_cluster_that_one_url_reaches():
    """`qrl redis --cluster 3`: three node URLs; a run created through one node is listed
    through another; Ctrl-C stops every node."""
    proc, urls, pids, banner = qrl_redis("--cluster", "3", nodes=3)
    try:
        assert len(set(urls)) == 3 and "a cluster of 3 nodes" in banner, (urls, banner)
        env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_PASSWORD"}
        created = qrl("run", "create", "apex", "--run", "cl1", "--redis", urls[2], env=env)
        assert created.returncode == 0, created.stderr
        listed = qrl("run", "list", "--json", "--redis", urls[0], env=env)
        assert [r["run"] for r in json.loads(listed.stdout)] == ["cl1"], listed.stdout
        with redis.Redis.from_url(urls[1]) as node:
            assert node.execute_command("CLUSTER INFO")["cluster_known_nodes"] == "3"
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    assert not any(map(pid_alive, pids))
