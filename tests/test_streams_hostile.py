"""Streams against a writer with the run's keys (issue 28, findings 5-9): oversized entries,
junk filling the stream, fake consumers, wrong-type keys, a destroyed group, Redis out of
memory. Each test drives the real consumer/producer against a real redis-server."""

import inspect
import logging
import time
import tracemalloc

import pytest
import redis

from qrl.jobs.acl import ACTOR_COMMANDS, Access, has_selectors, setuser_args
from qrl.runtime.roles import PRODUCER_SCRIPTS
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.streams import GROUP, PRUNE_MAX, StreamConsumer, StreamProducer
from tests.cluster import run_on
from tests.helpers import ITEM, item, url_of


def drain(c: StreamConsumer, rounds: int = 20) -> list[int]:
    got: list[int] = []
    for _ in range(rounds):
        c.process(lambda es: got.extend(e.data["seq"] for e in es), block_ms=10)
    return got


def test_oversized_entries_are_dead_lettered_without_being_fetched(r, keys):
    s = keys.experience
    big = b"x" * (8 << 20)
    r.xadd(s, {"d": item(0)})
    for _ in range(3):
        r.xadd(s, {"d": big})
    r.xadd(s, {"d": item(1)})
    c = StreamConsumer(r, keys, s, ITEM, count=10, block_ms=10, max_bytes=1 << 16)
    tracemalloc.start()
    try:
        got = drain(c, rounds=6)  # one oversized entry per read at most: bounded work
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [0, 1]
    assert peak < 2 << 20, f"read {peak} bytes into the consumer: oversized entries fetched"
    dead = r.xrange(keys.deadletter)
    assert len(dead) == 3 and c.rejected == 3
    for _, f in dead:
        assert f[b"payload"] == b"" and f[b"size"] == str(len(big) + 1).encode()
        assert b"over the" in f[b"reason"]
    assert r.xlen(s) == 0 and r.xpending(s, GROUP)["pending"] == 0


def test_own_pending_and_claimed_oversized_entries_are_screened_too(r, keys):
    s = keys.experience
    c = StreamConsumer(r, keys, s, ITEM, consumer="dead", count=10, block_ms=10)
    r.xadd(s, {"d": b"y" * (4 << 20)})
    r.xreadgroup(GROUP, "dead", {s: ">"})  # delivered to a consumer that then died
    r.xadd(s, {"d": b"z" * (4 << 20)})
    r.xreadgroup(GROUP, "other", {s: ">"})
    c = StreamConsumer(r, keys, s, ITEM, consumer="dead", count=10, block_ms=10, claim_idle_ms=0)
    c.max_bytes = 1 << 16
    tracemalloc.start()
    try:
        assert drain(c, rounds=3) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20 and c.rejected == 2
    assert r.xlen(s) == 0 and r.xpending(s, GROUP)["pending"] == 0


def test_junk_filling_the_stream_does_not_block_producers_forever(r, keys, caplog):
    s = keys.experience
    for _ in range(5):
        r.xadd(s, {"d": b"junk"})  # plain XADDs past the room check
    p = StreamProducer(r, s, maxlen=5, keys=keys, max_wait=0.3)
    with caplog.at_level(logging.WARNING, logger="qrl.wire.streams"):
        assert p.add(item(0)) == ""  # dropped after max_wait, not raised, not blocked
    assert p.dropped == 1 and "dropped" in caplog.text
    assert int(r.hget(keys.stats, "dropped:experience")) == 1
    assert r.xlen(s) == 5  # the cap still holds
    # the consumer drains the junk (dead-letters and deletes it), so room comes back
    c = StreamConsumer(r, keys, s, ITEM, count=10, block_ms=10)
    assert drain(c, rounds=2) == [] and c.rejected == 5 and r.xlen(s) == 0
    assert p.add(item(1)) not in ("", None)
    assert drain(c, rounds=2) == [1]


def test_a_flood_of_junk_costs_a_few_reads_not_one_per_entry(r, keys, caplog):
    """A writer's pipelined junk (2,000 entries, then 5 good ones) is rejected a batch at a
    time: a consumer asked for one entry at a time reaches the good ones in a few reads
    (before, a read and two more round trips per junk entry: slower than the writer adds
    them on a busy machine, so producers found the stream full for good), gets them one per
    read, in order, none lost; each is dead-lettered, the log says so once per reason."""
    s = keys.experience
    pipe = r.pipeline(transaction=False)
    for _ in range(2000):
        pipe.xadd(s, {"d": b"junk"})
    for i in range(5):
        pipe.xadd(s, {"d": item(i)})
    pipe.execute()
    c = StreamConsumer(r, keys, s, ITEM, count=1, block_ms=0)
    got, reads = [], 0
    with caplog.at_level(logging.WARNING, logger="qrl.wire.streams"):
        while len(got) < 5 and reads < 2100:
            entries = c.read()
            reads += 1
            assert len(entries) <= 1
            c.ack(entries)
            got += [e.data["seq"] for e in entries]
    assert got == [0, 1, 2, 3, 4] and reads < 40, (got, reads)
    assert c.rejected == 2000 and r.xlen(keys.deadletter) == 2000
    assert r.xlen(s) == 0 and r.xpending(s, GROUP)["pending"] == 0
    assert caplog.text.count("rejected experience entry") <= 1


def test_producers_wait_is_bounded_by_default():
    wait = inspect.signature(StreamProducer).parameters["max_wait"].default
    assert wait is not None and 0 < wait <= 600


def test_fake_consumers_do_not_stall_a_read(r, keys):
    s = keys.experience
    c = StreamConsumer(r, keys, s, ITEM, block_ms=1, claim_idle_ms=1)
    pipe = r.pipeline(transaction=False)
    for i in range(30_000):
        pipe.xgroup_createconsumer(s, GROUP, f"fake-{i}")
    pipe.execute()
    time.sleep(0.01)  # idle past claim_idle_ms (1 ms): XINFO would list 30,000 to watch it
    c._next_claim = 0.0
    c.read()
    left = r.xinfo_groups(s)[0]["consumers"]  # the fakes and the reader
    assert left == 30_001 - PRUNE_MAX  # bounded work per read: PRUNE_MAX removed, the rest later
    for _ in range(100):
        c._next_claim = 0.0
        c.read()
    assert r.xinfo_groups(s)[0]["consumers"] <= 1


@pytest.mark.parametrize("key", ["deadletter", "stats"])
def test_wrong_type_deadletter_or_stats_is_repaired(r, keys, key, caplog):
    s = keys.experience
    r.set(getattr(keys, key), "x")
    r.xadd(s, {"d": b"garbage"})
    r.xadd(s, {"d": item(0)})
    c = StreamConsumer(r, keys, s, ITEM, count=10, block_ms=10)
    with caplog.at_level(logging.WARNING, logger="qrl.wire.streams"):
        assert drain(c, rounds=2) == [0]
    assert r.xlen(s) == 0 and r.xpending(s, GROUP)["pending"] == 0
    assert r.type(keys.deadletter) == b"stream" and r.type(keys.stats) == b"hash"
    assert "wrong type" in caplog.text


def test_wrong_type_stream_and_destroyed_group_are_repaired(r, keys, caplog):
    s = keys.experience
    p = StreamProducer(r, s, keys=keys)
    c = StreamConsumer(r, keys, s, ITEM, count=10, block_ms=10)
    p.add(item(0))
    assert drain(c, rounds=1) == [0]
    r.delete(s)
    r.set(s, "x")  # the stream replaced by a string
    with caplog.at_level(logging.WARNING, logger="qrl.wire.streams"):
        assert drain(c, rounds=1) == []
        assert r.type(s) == b"stream"
        r.delete(s)
        r.set(s, "x")
        assert p.add(item(1))  # the producer repairs it too
        assert drain(c, rounds=2) == [1]
        r.xgroup_destroy(s, GROUP)  # NOGROUP
        p.add(item(2))
        assert drain(c, rounds=2) == [2]
        held = c.read()
        r.xgroup_destroy(s, GROUP)
        c.ack(held)  # acknowledging into a destroyed group does not end the role either
        r.set(keys.stats, "x")
        assert p.add(item(3))
    assert drain(c, rounds=2) == [3]
    assert "wrong type" in caplog.text and "group" in caplog.text


def test_a_stream_id_pushed_to_the_top_does_not_end_producers(r, keys):
    s = keys.experience
    r.xadd(s, {"d": b"junk"}, id="18446744073709551615-18446744073709551615")
    p = StreamProducer(r, s, keys=keys)
    assert p.add(item(0))
    c = StreamConsumer(r, keys, s, ITEM, count=10, block_ms=10)
    assert drain(c, rounds=2) == [0]


@pytest.mark.parametrize("how", ["plain", "connect"])  # connect(): waits OOM out elsewhere
def test_out_of_memory_dead_lettering_still_acks(caplog, how):
    keys = RunKeys(f"oom-{how}")
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        client = r if how == "plain" else connect(server.url)
        s = keys.experience
        c = StreamConsumer(client, keys, s, ITEM, count=10, block_ms=10)
        p = StreamProducer(client, s, keys=keys, max_wait=0.2)
        for _ in range(3):
            r.xadd(s, {"d": b"garbage"})
        r.xadd(s, {"d": item(0)})
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)  # below any use: every write that may grow it is refused
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            r.xadd("probe", {"a": "b"})  # Redis refuses writes now
        with caplog.at_level(logging.WARNING, logger="qrl.wire.streams"):
            assert drain(c, rounds=2) == [0]
            assert f"dead letters of {s} skipped" in caplog.text
            assert c.rejected == 3 and r.xlen(keys.deadletter) == 0  # refused, yet acked:
            assert r.xlen(s) == 0 and r.xpending(s, GROUP)["pending"] == 0
            assert p.add(item(1)) == ""  # an outage: dropped after max_wait, not a crash
            assert f"{s} skipped" in caplog.text
        r.close()


def test_screening_and_repairs_through_a_cluster_client(redis_cluster):
    keys = run_on(redis_cluster, 1, "hostile")
    client = connect(redis_cluster.urls[0])  # not the node that holds the run
    s = keys.experience
    c = StreamConsumer(client, keys, s, ITEM, count=10, block_ms=10, max_bytes=1 << 16)
    client.set(keys.deadletter, "x")
    client.xadd(s, {"d": b"y" * (1 << 20)})
    p = StreamProducer(client, s, keys=keys, max_wait=0.2)
    p.add(item(0))
    client.xgroup_destroy(s, GROUP)
    assert drain(c, rounds=4) == [0] and c.rejected == 1
    assert client.xlen(keys.deadletter) == 1 and client.xlen(s) == 0


def test_entries_skipped_by_moving_the_groups_id_are_still_delivered(r, keys):
    s = keys.experience
    p = StreamProducer(r, s, maxlen=3, keys=keys, max_wait=0.2)
    c = StreamConsumer(r, keys, s, ITEM, count=10, block_ms=10, claim_idle_ms=50)
    for i in range(3):
        p.add(item(i))
    r.xgroup_setid(s, GROUP, "$")  # the group skips them: nobody would ever be handed them
    assert sorted(drain(c, rounds=10)) == [0, 1, 2]
    assert r.xlen(s) == 0  # and the producers' room is back
    assert p.add(item(3)) not in ("", None)


@pytest.mark.parametrize("attack", ["stats wrong type", "stream wrong type", "ids used up"])
def test_an_actors_acl_user_repairs_what_it_adds_to(r, keys, attack):
    """An actor's user may only XADD, SET, DEL and HINCRBY: its producer's repairs use
    those (a wrong-type key is deleted with DEL where UNLINK is refused)."""
    user = f"{keys.run}.actor"
    writes = ("stats", "deadletter", "experience")
    access = Access(("config",), writes, ACTOR_COMMANDS, scripts=PRODUCER_SCRIPTS)
    r.execute_command("ACL", "SETUSER", *setuser_args(keys, access, user, "pw", has_selectors(r)))
    StreamConsumer(r, keys, keys.experience, ITEM)  # the group, made by a consumer's user
    actor = redis.Redis.from_url(url_of(r), username=user, password="pw")
    try:
        if attack == "stats wrong type":
            r.rpush(keys.stats, "x")
        elif attack == "stream wrong type":
            r.delete(keys.experience)
            r.set(keys.experience, "x")
        else:
            r.xadd(keys.experience, {"d": b"x"}, id="18446744073709551615-18446744073709551615")
        p = StreamProducer(actor, keys.experience, keys=keys, max_wait=0.2)
        assert p.add(item(0)) not in ("", None)
        with pytest.raises(redis.exceptions.NoPermissionError):
            actor.hset(keys.stats, "x", 1)  # the user is limited indeed
    finally:
        actor.close()
        r.acl_deluser(user)


@pytest.mark.parametrize("how", ["deleted", "a string", "group destroyed", "ids used up"])
def test_one_broken_stream_of_several_holds_no_other_back(r, keys, how, caplog):
    """A consumer of one stream per writer (each writer may break its own): one read still
    takes the other streams' entries, the broken one made again in the same script call, so
    a writer breaking its own in a loop cannot starve the others."""
    mine, other = keys.key("test:writer:0"), keys.key("test:writer:1")
    c = StreamConsumer(r, keys, [mine, other], ITEM, count=10, block_ms=10)
    assert c.read() == []
    r.xadd(other, {"d": item(7)})
    if how == "deleted":
        r.delete(mine)
    elif how == "a string":
        r.delete(mine)
        r.set(mine, "x")
    elif how == "group destroyed":
        r.xgroup_destroy(mine, GROUP)
    else:
        r.delete(mine)
        r.xadd(mine, {"d": b"x"}, id="18446744073709551615-18446744073709551615")
    with caplog.at_level(logging.WARNING, logger="qrl.wire.streams"):
        got = c.read()
    assert [(e.stream, e.data["seq"]) for e in got] == [(other, 7)]
    assert r.type(mine) == b"stream" and r.xinfo_groups(mine)[0]["name"] == b"qrl"
    assert "group" in caplog.text
    c.ack(got)
