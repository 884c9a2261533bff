"""What one role's user writes into a stream or a counter ends no other role (issue 68,
findings 2, 3 and 8): a stream whose ids someone used up is started afresh, a counter at
the int64 edge is reset with commands an actor's user has, a refused (NOPERM) or BUSY
reply is waited out, and the metrics reader never fetches an entry larger than a report.
Real redis-servers (Redis 7 for the per-role ACL users), real ``qrl`` roles."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import redis

from qrl.actors.feed import RateLimit
from qrl.algos.apex.config import ApexConfig
from qrl.jobs.acl import user_name
from qrl.jobs.launch import reporters
from qrl.runtime.loop import Role, run_role
from qrl.runtime.metrics import MetricsReader, report
from qrl.runtime.status import collect
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.codec import encode
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.stream_scripts import dead_letter
from qrl.wire.streams import FIELD, StreamProducer
from tests.cli import ROOT, qrl
from tests.helpers import kill_all, redis7, url_of, wait_until

ADMIN = "admin-pw-for-outage-tests"
EDGE = 2**63 - 1
LAST_ID = "18446744073709551615-18446744073709551615"  # no XADD * after it, ever


def _create_users(server: EmbeddedRedis, run: str, folder: Path) -> None:
    sets = ["--set", "learning_starts=200", "--set", "batch_size=32"]
    env = {**os.environ, "QRL_REDIS_URL": server.url, "QRL_REDIS_PASSWORD": ""}
    done = qrl("run", "create", "apex", "--run", run, "--acl", str(folder), *sets, env=env)
    assert done.returncode == 0, done.stderr


def _user(server: EmbeddedRedis, run: str, role: str, folder: Path) -> redis.Redis:
    password = (folder / role).read_text().strip()
    return redis.Redis(server.host, server.port, username=user_name(run, role), password=password)


def test_reports_and_dead_letters_go_on_after_their_streams_ids_were_used_up(r, keys, caplog):
    follower = MetricsReader(r, keys, [("actor", 0)])  # as `qrl train` follows, before it
    report(r, keys, "actor", 0, steps=1)
    assert [m["values"] for m in follower.read()] == [{"steps": 1}]
    for stream in (keys.metrics("actor", 0), keys.deadletter):
        r.xadd(stream, {"d": b"x"}, id=LAST_ID)
    with caplog.at_level(logging.WARNING):
        assert follower.read() == []  # the junk entry, dead-lettered: the follower is past it
        for i in range(3):  # the first repairs, the others just add
            report(r, keys, "actor", 0, steps=2 + i)
            assert dead_letter(r, keys, "test", "why", b"junk")
    assert r.xlen(keys.metrics("actor", 0)) == 3 and r.xlen(keys.deadletter) == 4
    # the follower follows the fresh stream from its start
    got = wait_until(follower.read, "the reports after the repair")
    assert [m["values"]["steps"] for m in got] == [2, 3, 4]
    used_up = [m for m in caplog.messages if "used up its stream ids" in m]
    assert len(used_up) == 1, caplog.messages  # one line per key, not one per report


def test_a_flood_of_many_processes_reports_keeps_no_other_process_out(r, keys):
    """A read takes up to 1,000 entries, the next entry of each stream in turn: the streams
    a read left unread go first in the next, however many entries the others hold."""
    flooded = [("actor", i) for i in range(1500)]
    pipe = r.pipeline(transaction=False)
    for source in flooded * 3:
        pipe.xadd(keys.metrics(*source), {FIELD: encode("metrics", {"time": 1.0, "values": {}})})
    pipe.execute()
    report(r, keys, "learner", 0, updates=7)
    reader = MetricsReader(r, keys, [*flooded, ("learner", 0)], from_start=True)
    first, second = reader.read(), reader.read()
    assert len(first) == len(second) == MetricsReader.COUNT
    assert [m["values"] for m in second if m["role"] == "learner"] == [{"updates": 7}]


def test_the_metrics_reader_never_fetches_an_entry_larger_than_a_report(r, keys):
    report(r, keys, "actor", 0, steps=1)
    junk, stream = b"\0" * (16 << 20), keys.metrics("actor", 0)
    for _ in range(5):
        r.xadd(stream, {FIELD: junk})
    report(r, keys, "actor", 0, steps=2)
    reader = MetricsReader(r, keys, [("actor", 0), ("learner", 0)], from_start=True)
    tracemalloc.start()
    try:
        got = []
        while msgs := reader.read():
            got += msgs
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [m["values"]["steps"] for m in got] == [1, 2]
    assert peak < 4 << 20, f"{peak / 2**20:.0f} MiB fetched"  # each junk entry is 16 MiB
    r.xadd(stream, {FIELD: junk})  # the newest entry: an idle follower never loads it
    loads = r.info("commandstats").get("cmdstat_xrevrange", {}).get("calls", 0)
    for _ in range(20):
        assert reader.read() == []
    assert r.info("commandstats").get("cmdstat_xrevrange", {}).get("calls", 0) == loads
    letters = r.xrange(keys.deadletter)
    assert [int(f[b"size"]) for _, f in letters] == [len(junk) + 1] * 6  # field name + value
    assert int(r.hget(keys.stats, "rejected:metrics")) == 6


def test_an_actors_count_at_the_int64_edge_is_reset_with_the_actors_own_commands(tmp_path):
    run, keys = "edge", RunKeys("edge")
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        _create_users(server, run, tmp_path / "pw")
        actor = _user(server, run, "actor", tmp_path / "pw")
        limit = RateLimit(actor, keys, ApexConfig(), share=2)
        assert limit.env_steps(10) == 10
        actor.hincrby(keys.stats, "env_steps", EDGE - 10)  # another actor's user
        actor.hincrby(keys.stats, "produced:experience", 7)
        assert limit.env_steps(30) == 30  # reset: 0 + our 20 new steps, at least ours
        assert int(actor.hget(keys.stats, "env_steps")) == 20
        actor.hincrby(keys.stats, "env_steps", -EDGE)  # far below 0: as garbage
        assert limit.env_steps(40) == 40 and int(actor.hget(keys.stats, "env_steps")) == 10
        assert actor.hget(keys.stats, "produced:experience") == b"7"  # the rest kept
        admin = redis.Redis.from_url(server.url)
        admin.hset(keys.stats, "env_steps", "garbage")  # HINCRBY cannot undo it: DEL can
        assert limit.env_steps(50) == 50 and int(actor.hget(keys.stats, "env_steps")) == 10


def test_stream_counters_at_the_int64_edge_start_again_under_an_actors_user(tmp_path):
    """The counters the stream scripts keep (``produced:*``, ``rejected``, ...) start again
    from 1 when someone left them at the edge, by commands an actor's user has (no HSET)."""
    run, keys = "counters", RunKeys("counters")
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        _create_users(server, run, tmp_path / "pw")
        actor = _user(server, run, "actor", tmp_path / "pw")
        fields = ["produced:experience", "rejected", "rejected:experience"]
        actor.hincrby(keys.stats, fields[0], EDGE)
        actor.hincrby(keys.stats, fields[1], EDGE)
        assert StreamProducer(actor, keys.experience, keys=keys).add(b"payload")
        assert dead_letter(actor, keys, "experience", "why", b"junk")
        assert actor.hmget(keys.stats, fields) == [b"1", b"1", b"1"]


class _Refused(Role):
    """A role whose first steps issue a command its user lacks (a rule without HDEL)."""

    name, counter = "actor", "steps"

    def __init__(self, client: redis.Redis, key: str, refusals: int) -> None:
        self.client, self.key, self.refusals, self.steps = client, key, refusals, 0

    def step(self, should_stop) -> bool:
        if self.refusals:
            self.refusals -= 1
            self.client.hdel(self.key, "x")
        self.steps += 1
        return True


def test_a_refused_step_is_waited_out_with_one_warning_not_an_exit(r, keys, caplog):
    r.execute_command(
        "ACL", "SETUSER", f"{keys.run}.nohdel", "on", ">pw", f"~{keys.prefix}*", "+@all", "-hdel"
    )
    user = redis.Redis.from_url(url_of(r), username=f"{keys.run}.nohdel", password="pw")
    role = _Refused(user, keys.key("h"), refusals=3)
    with caplog.at_level(logging.WARNING):
        assert run_role(role, user, keys, 0, lambda: False, limit=5) == 5
    refusals = [m for m in caplog.messages if "Redis refused" in m]
    assert len(refusals) == 1 and "hdel" in refusals[0], caplog.messages


@pytest.mark.slow
def test_a_busy_redis_is_waited_out_like_a_lost_one(tmp_path, caplog):
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("lua-time-limit", 50)  # BUSY after 50 ms (Redis 7: busy-reply-threshold)
        busy = "local t = redis.call('TIME')[1] while redis.call('TIME')[1] - t < 3 do end"
        loop = threading.Thread(target=lambda: redis.Redis.from_url(server.url).eval(busy, 0))
        client = connect(server.url)
        loop.start()
        try:

            def answers_busy() -> bool:
                try:
                    admin.ping()
                except redis.ResponseError as e:
                    return str(e).startswith("BUSY")
                return False

            wait_until(answers_busy, "Redis busy with the script", 10, every=0.02)
            with caplog.at_level(logging.WARNING):
                assert client.set("k", 1)  # waited for the script to end
        finally:
            loop.join(10)
        assert any("busy running a script" in m for m in caplog.messages), caplog.messages


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_apex_roles_under_their_own_users_outlive_an_actors_attack(tmp_path):
    """Every role of an Ape-X run under its own ACL user on Redis 7; one actor's user uses up
    the metrics, dead-letter and experience streams' ids and pushes the run's env-step count
    to the int64 edge (and a junk entry makes the replay filler dead-letter): every role
    goes on, the learner keeps updating, and each stops cleanly when asked."""
    run, keys = "attacked", RunKeys("attacked")
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        _create_users(server, run, tmp_path / "pw")
        admin = redis.Redis.from_url(server.url)
        procs: dict[str, subprocess.Popen] = {}
        for name, argv in [
            ("replay", ["replay"]),
            ("learner", ["learner", "apex"]),
            ("actor0", ["actor", "apex", "--id", "0"]),
            ("actor1", ["actor", "apex", "--id", "1"]),
        ]:
            role = argv[0]
            env = {
                **os.environ,
                "QRL_REDIS_URL": f"redis://{user_name(run, role)}@127.0.0.1:{server.port}/0",
                "QRL_REDIS_PASSWORD_FILE": str(tmp_path / "pw" / role),
                "QRL_REDIS_PASSWORD": "",
                "QRL_RUN": run,
            }
            log = (tmp_path / f"{name}.log").open("w")
            command = [sys.executable, "-m", "qrl.cli", "-v", *argv]
            procs[name] = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=log)

        def logs() -> str:
            files = sorted(tmp_path.glob("*.log"))
            return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in files)

        def alive() -> None:
            for name, p in procs.items():
                assert p.poll() is None, f"{name} exited ({p.returncode})\n{logs()}"

        def version() -> int:
            return int(admin.hget(keys.weights, "version") or 0)

        try:
            wait_until(version, "the learner's first updates", 120, between=alive)
            follower = MetricsReader(admin, keys, reporters(admin, keys))
            attacker = _user(server, run, "actor", tmp_path / "pw")
            attacker.xadd(keys.metrics("actor", 0), {"d": b"x"}, id=LAST_ID)
            attacker.xadd(keys.deadletter, {"d": b"x"}, id=LAST_ID)
            attacker.xadd(keys.experience, {"d": b"junk"})  # the filler dead-letters it

            def dead_lettered() -> bool:  # into the used-up dead letters: restarted
                letters = admin.xrange(keys.deadletter)
                return any(f.get(b"source") == b"experience" for _, f in letters)

            wait_until(dead_lettered, "the junk entry dead-lettered", 60, between=alive)
            attacker.xadd(keys.experience, {"d": b"x"}, id=LAST_ID)  # an actor restarts it

            def to_the_edge() -> bool:
                now = int(attacker.hget(keys.stats, "env_steps") or 0)
                try:
                    attacker.hincrby(keys.stats, "env_steps", EDGE - now)
                except redis.ResponseError:  # an actor added in between
                    return False
                return True

            wait_until(to_the_edge, "env_steps at the int64 edge", 10, every=0.01)
            attacked, before = time.time(), version()

            def beating() -> set[str]:  # a report (and heartbeat) 2 s after the attack: 2 went
                procs = collect(admin, keys)["processes"]
                return {f"{p['role']}.{p['id']}" for p in procs if p["time"] > attacked + 2}

            wait_until(lambda: len(beating()) == 4, "every role reporting on", 60, between=alive)
            wait_until(lambda: version() > before + 20, "more updates", 120, between=alive)

            def read_again() -> bool:  # restarted by an actor (DEL), its group by the filler
                if admin.xinfo_stream(keys.experience)["last-generated-id"] == LAST_ID.encode():
                    return False
                groups = admin.xinfo_groups(keys.experience)
                return any(g["last-delivered-id"] != b"0-0" for g in groups if g["name"] == b"qrl")

            wait_until(read_again, "the experience stream restarted and read", 60, between=alive)
            heard: set[str] = set()

            def reporting() -> bool:
                heard.update(f"{m['role']}.{m['id']}" for m in follower.read())
                return len(heard) == 4

            wait_until(reporting, "every role reporting", 60, between=alive)
            assert heard == {"replay.0", "learner.0", "actor.0", "actor.1"}
            assert int(admin.hget(keys.stats, "env_steps")) < 2**40  # reset by an actor
            admin.hset(keys.control, "stop", 1)
            for name, p in procs.items():
                assert p.wait(60) == 0, f"{name}\n{logs()}"
            assert "NOPERM" not in logs() and "Traceback" not in logs()
        finally:
            kill_all(procs.values())
