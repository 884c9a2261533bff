"""Per-instance ACL users (``qrl run join`` / ``qrl run revoke``): one machine's user reaches
the keys of its own process only (lease, heartbeats, a stepper's request and reply lists),
its process takes that number, and a revoked user is gone. Real Redis 7 (the per-instance
users need its read-only key patterns), real ``qrl`` roles."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from qrl.algos import ALGOS
from qrl.inference import protocol
from qrl.jobs.acl import user_name
from qrl.jobs.launch import reporters
from qrl.runtime.config import parse_config
from qrl.runtime.ids import instance_user
from qrl.runtime.metrics import MetricsReader, report
from qrl.runtime.runlog import Progress
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys
from qrl.wire.streams import FIELD
from tests.cli import ROOT, qrl
from tests.helpers import kill_all, redis7, wait_until
from tests.test_acl import ADMIN, _create, _learner_updates_then_all_stop


def _join(server: EmbeddedRedis, run: str, role: str, folder: Path, *more: str):
    return qrl(
        "run",
        "join",
        run,
        role,
        "--acl",
        str(folder),
        *more,
        env={**os.environ, "QRL_REDIS_URL": server.url, "QRL_REDIS_PASSWORD": ""},
    )


def _as(server: EmbeddedRedis, user: str, password_file: Path) -> redis.Redis:
    password = password_file.read_text().strip()
    return redis.Redis(server.host, server.port, username=user, password=password)


def _refused(*attempts) -> None:
    for i, attempt in enumerate(attempts):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
            pytest.fail(f"attempt {i} was allowed")


@pytest.mark.slow
def test_a_joined_stepper_reaches_its_own_lists_lease_and_heartbeat_only(tmp_path):
    run, keys, pw = "join-seed", RunKeys("join-seed"), tmp_path / "pw"
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        done = _create(server, "impala", run, pw, "--set", "inference=central")
        assert done.returncode == 0, done.stderr
        for n in (0, 1):  # the smallest number without a user, each time
            done = _join(server, run, "stepper", pw)
            assert done.returncode == 0, done.stderr
            assert f"ACL user {run}.stepper.{n} for stepper {n}" in done.stdout
            assert oct((pw / f"stepper.{n}").stat().st_mode & 0o777) == "0o600"
        me = _as(server, instance_user(run, "stepper", 0), pw / "stepper.0")
        mine, other = protocol.requests(keys, 0), protocol.requests(keys, 1)
        replies = [protocol.reply(keys, 0, 0), protocol.reply(keys, 1, 0)]
        admin.rpush(other, b"stepper 1's request")
        admin.rpush(replies[1], b"stepper 1's reply")
        _refused(
            lambda: me.blpop([replies[1]], timeout=0.01),  # stealing its replies
            lambda: me.lrange(replies[1], 0, -1),
            lambda: me.delete(replies[1]),
            lambda: me.rpush(replies[1], b"a forged reply"),
            lambda: me.lrange(other, 0, -1),  # reading its requests (life, seq)
            lambda: me.lpop(other),
            lambda: me.delete(other),
            lambda: me.rpush(other, b"a request posing as stepper 1"),
            lambda: me.set(keys.lease("stepper", 1), b"h:1:t", ex=10),
            lambda: me.delete(keys.lease("stepper", 1)),
            lambda: me.set(keys.proc("stepper.1@h:1"), b"x", ex=10),
            lambda: me.set(keys.proc("stepper.10@h:1"), b"x", ex=10),
            lambda: me.xadd(keys.metrics("stepper", 1), {"d": b"x"}),
            lambda: me.set(keys.config, b"x"),
        )
        # what stepper 0 does is allowed: under its server's keys (a shard's, with two)
        for server_keys in (keys, protocol.server_keys(keys, 2, 0)):
            assert me.rpush(protocol.requests(server_keys, 0), b"request") == 1
            assert me.blpop([protocol.reply(server_keys, 0, 1)], timeout=0.01) is None
        assert me.set(keys.lease("stepper", 0), b"h:1:t", ex=10)
        assert me.set(keys.proc("stepper.0@h:1"), b"x", ex=10)
        assert me.xadd(keys.metrics("stepper", 0), {"d": b"x"})
        assert admin.lrange(other, 0, -1) == [b"stepper 1's request"]
        # revoked: its connections dropped, its password refused, its keys gone
        done = qrl(
            "run",
            "revoke",
            run,
            "stepper",
            "0",
            env={**os.environ, "QRL_REDIS_URL": server.url, "QRL_REDIS_PASSWORD": ""},
        )
        assert done.returncode == 0, done.stderr
        with pytest.raises(redis.exceptions.ConnectionError):  # (AuthenticationError too)
            me.get(keys.config)
        with pytest.raises(redis.exceptions.AuthenticationError):
            _as(server, instance_user(run, "stepper", 0), pw / "stepper.0").ping()
        assert not admin.exists(
            mine, keys.lease("stepper", 0), keys.proc("stepper.0@h:1"), keys.metrics("stepper", 0)
        )
        assert admin.exists(other, keys.config)
        done = _join(server, run, "stepper", pw)  # the number is free again: a new password
        assert done.returncode == 0 and f"{run}.stepper.0 " in done.stdout, done.stderr


@pytest.mark.slow
def test_a_joined_actor_cannot_touch_another_actors_lease_or_heartbeat(tmp_path):
    run, keys, pw = "join-apex", RunKeys("join-apex"), tmp_path / "pw"
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        assert _create(server, "apex", run, pw).returncode == 0
        done = _join(server, run, "actor", pw, "--id", "3")
        assert done.returncode == 0, done.stderr
        me = _as(server, instance_user(run, "actor", 3), pw / "actor.3")
        _refused(
            lambda: me.set(keys.lease("actor", 0), b"h:1:t", ex=10),
            lambda: me.set(keys.lease("actor", 30), b"h:1:t", ex=10),
            lambda: me.get(keys.lease("actor", 0)),
            lambda: me.set(keys.proc("actor.0@h:1"), b"x", ex=10),
            lambda: me.delete(keys.proc("actor.0@h:1")),
        )
        assert me.set(keys.lease("actor", 3), b"h:1:t", ex=10)
        assert me.xadd(keys.experience, {"d": b"x"})
        # numbers stay below claim_id's limit (2 x 2 actors + 8): epsilons are spread on them
        done = _join(server, run, "actor", pw, "--id", "12")
        assert done.returncode == 1 and "from 0 to 11" in done.stderr


def test_a_joined_actor_reports_as_itself_only(tmp_path):
    """A joined actor writes its own metrics stream only: not another process's, nor the one
    stream every process reported to before, where it could report as the learner or as
    another actor. A report in its own stream that names another process is refused, and
    what the run log shows of it is actor 1's own. Reading the run's reports takes the
    metrics reader's script, which only roles that log the run (the learner's) may run: an
    actor's user is refused it."""
    run, keys, pw = "join-metrics", RunKeys("join-metrics"), tmp_path / "pw"
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        assert _create(server, "apex", run, pw).returncode == 0
        assert _join(server, run, "actor", pw, "--id", "1").returncode == 0
        me = _as(server, instance_user(run, "actor", 1), pw / "actor.1")
        claim = {"role": "learner", "id": 0, "time": time.time(), "values": {"updates": 10**6}}
        forged = {FIELD: encode("metrics", claim)}
        _refused(
            lambda: me.xadd(keys.key("metrics"), forged),  # the stream all shared, before
            lambda: me.xadd(keys.metrics("learner", 0), forged),
            lambda: me.xadd(keys.metrics("actor", 0), forged),
            lambda: me.delete(keys.metrics("actor", 0)),
        )
        report(admin, keys, "actor", 0, steps=100, episode_returns=[10.0])
        report(admin, keys, "learner", 0, updates=7)
        report(me, keys, "actor", 1, steps=5, episode_returns=[20.0])  # its own
        me.xadd(keys.metrics("actor", 1), forged)  # in its own stream, naming the learner
        progress = Progress(ALGOS["apex"].reports)
        for msg in MetricsReader(admin, keys, reporters(admin, keys), True).read():
            progress.fold(msg)
        row = progress.row()
        assert (row["updates"], row["env_steps"], row["episodes"]) == (7, 105, 2), row
        assert row["episodic_return"] == 15.0
        assert int(admin.hget(keys.stats, "rejected:metrics")) == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            MetricsReader(me, keys, reporters(admin, keys), True).read()


# each case: the algorithm, its settings and the role whose processes join as their own user
JOINED = {
    "apex": ("apex", {"learning_starts": 200, "batch_size": 32}, "actor"),
    "impala-central": ("impala", {"inference": "central"}, "stepper"),
}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", JOINED)
def test_joined_processes_work_under_their_own_users(case, tmp_path):
    """The role's processes, each as the user ``qrl run join`` issued it, take their own
    numbers and feed a learner that updates; the others run as their role's user."""
    algo, settings, joined = JOINED[case]
    run, keys, pw = f"j-{case}", RunKeys(f"j-{case}"), tmp_path / "pw"
    spec = ALGOS[algo]
    cfg = parse_config(spec.config, settings)
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        assert _create(server, algo, run, pw, *sets).returncode == 0
        users = {}
        for role, n in spec.processes(cfg):
            if role.name == joined:  # numbers given the other way round: joined ones are used
                n = cfg.actors - 1 - n
                assert _join(server, run, joined, pw, "--id", str(n)).returncode == 0
                users[role, n] = (instance_user(run, joined, n), pw / f"{joined}.{n}")
            else:
                users[role, n] = (user_name(run, role.name), pw / role.name)
        procs = {}
        for (role, n), (user, password) in users.items():
            limit = ["--max-updates", "3"] if role.checkpoints else []
            env = {
                **os.environ,
                "QRL_REDIS_URL": f"redis://{user}@127.0.0.1:{server.port}/0",
                "QRL_REDIS_PASSWORD_FILE": str(password),
                "QRL_REDIS_PASSWORD": "",
                "QRL_RUN": run,
            }
            log = (tmp_path / f"{role.name}.{n}.log").open("w")
            procs[role, n] = subprocess.Popen(
                [sys.executable, "-m", "qrl.cli", *role.command, *limit],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            admin = redis.Redis.from_url(server.url)
            for n in range(cfg.actors):  # each joined process holds the number of its user
                wait_until(lambda n=n: admin.get(keys.lease(joined, n)), f"{joined} {n}'s lease")
            learner = next(p for (r, _), p in procs.items() if r.checkpoints)
            _learner_updates_then_all_stop(server, spec, keys, learner, procs.values(), tmp_path)
        finally:
            kill_all(procs.values())


@pytest.mark.slow
def test_a_joined_user_cannot_start_as_another_number(tmp_path):
    run, pw = "join-id", tmp_path / "pw"
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        assert _create(server, "apex", run, pw).returncode == 0
        assert _join(server, run, "actor", pw).returncode == 0
        env = {
            **os.environ,
            "QRL_REDIS_URL": f"redis://{instance_user(run, 'actor', 0)}@127.0.0.1:{server.port}/0",
            "QRL_REDIS_PASSWORD_FILE": str(pw / "actor.0"),
            "QRL_REDIS_PASSWORD": "",
            "QRL_RUN": run,
        }
        done = qrl("actor", "apex", "--id", "1", env=env, timeout=120)
        assert done.returncode == 1 and "is not its" in done.stderr, done.stderr


def test_run_delete_deletes_the_runs_joined_users_and_no_other_runs(tmp_path):
    from qrl.jobs.acl import join_user
    from qrl.runtime.runs import create_run

    run, pw = "join-del", tmp_path / "pw"
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        algo = ALGOS["apex"]
        cfg = parse_config(algo.config, {})
        for name in (run, f"{run}2", f"{run}.b"):  # names that begin as this one does
            create_run(admin, RunKeys(name), "apex", cfg)
            for _ in range(2):  # what `qrl run join` does
                join_user(admin, algo, RunKeys(name), cfg, "actor", None, pw / name)
        done = qrl(
            "run",
            "delete",
            run,
            "--yes",
            env={**os.environ, "QRL_REDIS_URL": server.url, "QRL_REDIS_PASSWORD": ""},
        )
        assert done.returncode == 0 and "2 joined ACL users" in done.stdout, done.stderr
        users = set(admin.acl_users())
        assert not {instance_user(run, "actor", 0), instance_user(run, "actor", 1)} & users
        for other in (f"{run}2", f"{run}.b"):
            assert {instance_user(other, "actor", 0), instance_user(other, "actor", 1)} <= users
            assert admin.exists(RunKeys(other).config)
