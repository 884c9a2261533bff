"""The sharded replay in whole jobs: one shard's filler SIGKILLed and restarted mid-run,
``qrl train apex --set replay_shards=3`` on one Redis and on a three-node Redis Cluster
(the ``redis_cluster`` fixture, tests/cluster.py). Real processes, real redis-servers."""

from __future__ import annotations

import json
import os

import pytest

from qrl.algos.apex.config import ApexConfig
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import q_network
from qrl.runtime.runs import delete_run
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.streams import GROUP
from qrl.wire.weights import WeightStore
from tests.cli import qrl, train
from tests.helpers import Roles

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_sigkill_one_shards_filler_and_restart_it_loses_no_batch(r, keys, tmp_path):
    """Three shards, a filler each, two actors: shard 1's filler is SIGKILLed while it holds
    entries and a new one (``--id auto``) takes its number and shard back; every batch the
    actors' producers had acknowledged ends up in its shard's replay exactly once."""
    created = qrl(
        "run",
        "create",
        "apex",
        "--run",
        keys.run,
        "--set",
        "replay_shards=3",
        "--set",
        "claim_idle_ms=1500",
        "--set",
        "replay_capacity=1000000",
        "--set",
        "actor_batch=48",
        "--set",
        "steps_per_update=0",
    )
    assert created.returncode == 0, created.stderr
    cfg = ApexConfig(replay_shards=3)
    net = q_network(cfg, EnvSpec.of(cfg.env))  # the network the actors build
    WeightStore(r, keys).publish(net, 0)
    shards = keys.shards(3)
    roles = Roles(keys.run, tmp_path)

    def inserted(s: int) -> int:
        return int(r.hget(shards[s].replay_meta, "inserted") or 0)

    try:
        for s in range(3):
            roles.start(f"replay-{s}", "replay", "--id", str(s))
        roles.start("actor-a", "actor", "apex")
        roles.start("actor-b", "actor", "apex")
        roles.until(
            lambda: [inserted(s) for s in range(3)],
            "every shard to fill",
            until=lambda x: min(x) > 500,
        )
        roles.kill_holding("replay-1", r, shards[1].experience)
        n = inserted(1)
        roles.start("replay-1b", "replay")  # --id auto: the dead one's number, so shard 1
        roles.until(lambda: inserted(1), "the new filler to insert", until=lambda x: x > n + 500)
        assert "filler 1 drains shard 1 of 3" in roles.log("replay-1b")
        # the entries the dead filler held go to the new one once idle for claim_idle_ms
        roles.until(lambda: "claimed" in roles.log("replay-1b"), "the held entries", 30)

        assert roles.stop("actor-a", "actor-b") == {"actor-a": 0, "actor-b": 0}
        roles.until(
            lambda: all(
                r.xlen(k.experience) == 0 and r.xpending(k.experience, GROUP)["pending"] == 0
                for k in shards
            ),
            "every shard's stream to drain",
        )
        for s, k in enumerate(shards):
            produced = int(r.hget(k.stats, "produced:experience"))  # acknowledged XADDs
            assert produced > 10 and r.xlen(k.deadletter) == 0
            assert r.zcard(k.replay_batches) == produced  # none lost, none twice
            assert int(r.hget(k.replay_meta, "batches")) == produced
            assert r.zcard(k.replay_priorities) == inserted(s)
        stopped = roles.stop("replay-0", "replay-1b", "replay-2")
        assert stopped == {"replay-0": 0, "replay-1b": 0, "replay-2": 0}
    finally:
        roles.cleanup()


@pytest.mark.timeout(300)
def test_train_apex_with_three_shards_solves_cartpole(tmp_path):
    run_dir = tmp_path / "run"
    result = train(
        "apex",
        run_dir,
        "--env",
        "CartPole-v1",
        "--seed",
        "0",
        "--set",
        "replay_shards=3",
        "--max-time",
        "150",
    )
    assert result["reached"] and result["eval_return"] >= 475
    logs = run_dir / "logs"
    assert sorted(p.name for p in logs.glob("replay*.log")) == [f"replay{s}.log" for s in range(3)]
    for s in range(3):
        assert f"filler {s} drains shard {s} of 3" in (logs / f"replay{s}.log").read_text()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["replay_shards"] == 3


@pytest.mark.timeout(500)
def test_train_apex_with_three_shards_solves_cartpole_on_a_cluster(redis_cluster, tmp_path):
    """Through one node's URL: the shards' hash tags put each shard on its own node of the
    three (slots split in thirds), beside the run's other keys on the node of ``{RUN}``."""
    keys = RunKeys("sharded-train")
    env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_URL"}
    env["QRL_REDIS_PASSWORD"] = redis_cluster.password  # the URL without it: no ps warning
    run_dir = tmp_path / "run"
    out = qrl(
        "train",
        "apex",
        "--env",
        "CartPole-v1",
        "--seed",
        "0",
        "--run",
        keys.run,
        "--run-dir",
        str(run_dir),
        "--set",
        "replay_shards=3",
        "--max-time",
        "150",
        "--redis",
        redis_cluster.addresses[1],
        env=env,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "result.json").read_text())["reached"]
    held = [{k.decode() for k in node} for node in redis_cluster.keys_per_node(keys.pattern())]
    assert sum(1 for node in held if node) >= 2, held  # spread over at least two nodes
    inserted = []
    for s, k in enumerate(keys.shards(3)):  # in fact shard s on node s
        assert {k.replay_priorities, k.replay_data, k.replay_meta, k.experience} <= held[s]
        inserted.append(int(redis_cluster.client(s).hget(k.replay_meta, "inserted")))
    # every shard filled with its env slots' share (16 slots: 6/5/5), however fast it solved
    assert sum(inserted) > 1000 and min(inserted) > 0.2 * sum(inserted), inserted
    for log in (run_dir / "logs").iterdir():
        assert "Traceback" not in log.read_text(), log.name
    with connect(redis_cluster.urls[2]) as client:
        delete_run(client, keys)
    assert redis_cluster.keys_per_node(keys.pattern()) == [[], [], []]
