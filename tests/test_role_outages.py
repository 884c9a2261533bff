"""What one role's user writes into a stream or a counter ends no other role (issue 68,
findings 2, 3 and 8): a stream whose ids someone used up is started afresh, a counter at
the int64 edge is reset with commands an actor's user has, a refused (NOPERM) or BUSY
reply is waited out, and the metrics reader never fetches an entry larger than a report.
Real redis-servers (Redis 7 for the per-role ACL users), real ``qrl`` roles."""

from __future__ import annotations

import logging
import threading
import tracemalloc

import redis

from qrl.runtime.metrics import MetricsReader, report
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.stream_scripts import dead_letter
from qrl.wire.streams import FIELD
from tests.helpers import wait_until

LAST_ID = "18446744073709551615-18446744073709551615"  # no XADD * after it, ever


def test_reports_and_dead_letters_go_on_after_their_streams_ids_were_used_up(r, keys, caplog):
    follower = MetricsReader(r, keys)  # as `qrl train` follows a run, from before the attack
    report(r, keys, "actor", 0, steps=1)
    assert [m["values"] for m in follower.read()] == [{"steps": 1}]
    for stream in (keys.metrics, keys.deadletter):
        r.xadd(stream, {"d": b"x"}, id=LAST_ID)
    with caplog.at_level(logging.WARNING):
        assert follower.read() == []  # the junk entry, dead-lettered: the follower is past it
        for i in range(3):  # the first repairs, the others just add
            report(r, keys, "actor", 0, steps=2 + i)
            assert dead_letter(r, keys, "test", "why", b"junk")
    assert r.xlen(keys.metrics) == 3 and r.xlen(keys.deadletter) == 4
    # the follower follows the fresh stream from its start
    got = wait_until(follower.read, "the reports after the repair")
    assert [m["values"]["steps"] for m in got] == [2, 3, 4]
    used_up = [m for m in caplog.messages if "used up its stream ids" in m]
    assert len(used_up) == 1, caplog.messages  # one line per key, not one per report


def test_the_metrics_reader_never_fetches_an_entry_larger_than_a_report(r, keys):
    report(r, keys, "actor", 0, steps=1)
    junk = b"\0" * (16 << 20)
    for _ in range(5):
        r.xadd(keys.metrics, {FIELD: junk})
    report(r, keys, "actor", 0, steps=2)
    reader = MetricsReader(r, keys, from_start=True)
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
    r.xadd(keys.metrics, {FIELD: junk})  # the newest entry: an idle follower never loads it
    loads = r.info("commandstats").get("cmdstat_xrevrange", {}).get("calls", 0)
    for _ in range(20):
        assert reader.read() == []
    assert r.info("commandstats").get("cmdstat_xrevrange", {}).get("calls", 0) == loads
    letters = r.xrange(keys.deadletter)
    assert [int(f[b"size"]) for _, f in letters] == [len(junk) + 1] * 6  # field name + value
    assert int(r.hget(keys.stats, "rejected:metrics")) == 6


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
