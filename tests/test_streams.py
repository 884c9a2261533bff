import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import redis

from qrl.server.embedded import EmbeddedRedis
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys
from qrl.wire.streams import GROUP, StreamConsumer, StreamProducer
from tests.cli import ROOT
from tests.helpers import ITEM, item, reads_of, url_of, wait_until


def test_produce_consume_ack_deletes(r, keys):
    p = StreamProducer(r, keys.experience, maxlen=100)
    for i in range(40):
        p.add(item(i))
    c = StreamConsumer(r, keys, keys.experience, ITEM, count=16, block_ms=10)
    got = []
    xs = []
    while c.process(lambda es: (got.extend(e.data["seq"] for e in es), xs.extend(es))):
        pass
    assert got == list(range(40))
    np.testing.assert_array_equal(xs[7].data["x"], np.full(3, 7, np.float32))
    assert r.xlen(keys.experience) == 0  # acknowledged entries are deleted
    assert r.xpending(keys.experience, GROUP)["pending"] == 0


def test_handler_failure_leaves_entries_pending(r, keys):
    StreamProducer(r, keys.experience).add(item(1))
    c = StreamConsumer(r, keys, keys.experience, ITEM, block_ms=10)

    def boom(entries):
        raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError):
        c.process(boom)
    assert r.xpending(keys.experience, GROUP)["pending"] == 1
    # the same consumer name, restarted, re-reads its own pending entry first
    again = StreamConsumer(r, keys, keys.experience, ITEM, consumer=c.consumer, block_ms=10)
    assert [e.data["seq"] for e in again.read()] == [1]


def test_producer_backs_off_when_full_and_drops_only_after_max_wait(r, keys):
    p = StreamProducer(r, keys.experience, maxlen=5, max_wait=0.2)
    for i in range(5):
        p.add(item(i))
    assert p.add(item(99)) == "" and p.dropped == 1  # dropped after 0.2 s, not added
    assert r.xlen(keys.experience) == 5

    # a blocked producer proceeds as soon as the consumer makes room; the cap is never exceeded
    p = StreamProducer(r, keys.experience, maxlen=5, max_delay=0.01)
    lengths = []
    done = threading.Event()

    def produce():
        for i in range(5, 30):
            p.add(item(i))
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    c = StreamConsumer(r, keys, keys.experience, ITEM, count=2, block_ms=50)
    got = []

    def consume() -> None:
        lengths.append(r.xlen(keys.experience))
        c.process(lambda es: got.extend(e.data["seq"] for e in es))

    wait_until(
        lambda: done.is_set() and r.xlen(keys.experience) == 0,
        "the producer to end and the stream to drain",
        60,
        every=0.005,
        between=consume,
    )
    t.join()
    assert got == list(range(30))  # nothing dropped, order kept
    assert max(lengths) <= 5
    assert p.waited_s > 0


def test_should_stop_releases_a_blocked_producer(r, keys):
    p = StreamProducer(r, keys.experience, maxlen=1)
    assert p.add(item(0)) is not None
    assert p.add(item(1), should_stop=lambda: True) is None
    assert r.xlen(keys.experience) == 1


def test_undecodable_entries_go_to_dead_letter(r, keys):
    s = keys.experience
    r.xadd(s, {"d": item(0)})
    r.xadd(s, {"d": b"garbage"})
    r.xadd(s, {"d": encode("item", {"seq": "not an int", "x": np.zeros(1, np.float32)})})
    r.xadd(s, {"other": b"x"})
    r.xadd(s, {"d": item(1)})
    c = StreamConsumer(r, keys, s, ITEM, count=10, block_ms=10)
    got = []
    c.process(lambda es: got.extend(e.data["seq"] for e in es))
    assert got == [0, 1]
    dead = r.xrange(keys.deadletter)
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert len(reasons) == 3 and c.rejected == 3
    assert "LZ4" in reasons[0] and "must be int" in reasons[1] and "exactly [d]" in reasons[2]
    assert dead[0][1][b"payload"] == b"garbage" and dead[0][1][b"source"] == b"experience"
    assert int(r.hget(keys.stats, "rejected")) == 3
    assert int(r.hget(keys.stats, "rejected:experience")) == 3
    assert r.xlen(s) == 0 and r.xpending(s, GROUP)["pending"] == 0
    r.xadd(s, {"d": item(2)})  # and the consumer keeps going
    c.process(lambda es: got.extend(e.data["seq"] for e in es))
    assert got == [0, 1, 2]


def test_consumer_killed_mid_batch_loses_nothing(r, keys, redis_server):
    n = 50
    p = StreamProducer(r, keys.experience, maxlen=1000)
    for i in range(n):
        p.add(item(i))
    victim = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_victim_consumer.py"), redis_server.url, keys.run],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=60,
    )
    assert victim.returncode == -9, victim.stderr.decode()
    acked = [int(x) for x in r.lrange(keys.prefix + "test:victim_acked", 0, -1)]
    inflight = [int(x) for x in r.lrange(keys.prefix + "test:victim_inflight", 0, -1)]
    assert acked == list(range(10)) and inflight == list(range(10, 20))
    assert r.xpending(keys.experience, GROUP)["pending"] == 10  # the dead consumer's batch

    survivor = StreamConsumer(r, keys, keys.experience, ITEM, claim_idle_ms=100, block_ms=10)
    processed: list[int] = []

    def process() -> list[int]:
        survivor.process(lambda es: processed.extend(e.data["seq"] for e in es))
        return processed

    left = n - len(acked)
    wait_until(process, f"{left} entries processed", 10, until=lambda p: len(p) >= left, every=0)
    assert sorted(processed) == list(range(10, n))  # the in-flight batch was claimed
    assert not set(processed) & set(acked)  # nothing acknowledged is processed twice
    assert len(processed) == len(set(processed))
    assert r.xlen(keys.experience) == 0 and r.xpending(keys.experience, GROUP)["pending"] == 0


def test_a_consumer_holding_more_than_maxlen_for_one_batch_does_not_deadlock(r, keys):
    p = StreamProducer(r, keys.experience, maxlen=2, max_wait=5)
    c = StreamConsumer(r, keys, keys.experience, ITEM, count=1, block_ms=50)
    held = []
    t = threading.Thread(target=lambda: [p.add(item(i)) for i in range(6)])
    t.start()

    def read() -> list:
        held.extend(c.read())
        return held

    wait_until(read, "a batch of 6, unacknowledged", 10, until=lambda h: len(h) >= 6, every=0)
    t.join()
    assert [e.data["seq"] for e in held] == list(range(6))
    c.ack(held)
    assert r.xlen(keys.experience) == 0


def _idle_past(r, stream: str, ms: int) -> None:
    """Wait until every pending entry of ``stream`` has been idle more than ``ms`` by Redis's
    own count, what makes an entry claimable."""
    wait_until(
        lambda: [e["time_since_delivered"] for e in r.xpending_range(stream, GROUP, "-", "+", 100)],
        f"the pending entries to be idle past {ms} ms",
        10,
        until=lambda idle: idle and min(idle) > ms,
        every=0.005,
    )


def _consumer_idle_past(r, stream: str, name: str, ms: int) -> None:
    """Wait until consumer ``name`` of ``stream`` has been idle more than ``ms`` (Redis's
    count), what lets another's claim scans remove it (or is gone)."""
    wait_until(
        lambda: {c["name"].decode(): c["idle"] for c in r.xinfo_consumers(stream, GROUP)},
        f"consumer {name} to be idle past {ms} ms",
        10,
        until=lambda idle: idle.get(name, ms + 1) > ms,
        every=0.005,
    )


def test_held_entries_are_not_delivered_twice(r, keys):
    p = StreamProducer(r, keys.experience)
    for i in range(3):
        p.add(item(i))
    c = StreamConsumer(r, keys, keys.experience, ITEM, count=10, claim_idle_ms=20, block_ms=10)
    first = c.read()
    assert [e.data["seq"] for e in first] == [0, 1, 2]
    _idle_past(r, keys.experience, 20)  # claimable, but we still hold them
    c._next_claim = 0.0  # its next read scans the pending entries
    assert c.read() == [] and c.read() == []
    # a restarted consumer of the same name re-reads its pending entries once, then moves on
    again = StreamConsumer(
        r, keys, keys.experience, ITEM, consumer=c.consumer, count=10, block_ms=10
    )
    assert [e.data["seq"] for e in again.read()] == [0, 1, 2]
    p.add(item(3))
    assert [e.data["seq"] for e in again.read()] == [3]
    assert again.read() == []


def test_deferred_acknowledgements_go_in_the_next_reads_round_trip():
    """A consumer far from Redis pays a round trip for each call: entries it defers the
    acknowledgement of stay pending, held, until its next read, and go in that read's round
    trip (or the next ack's, or at its close)."""
    keys = RunKeys("deferred")
    with EmbeddedRedis() as server, redis.Redis.from_url(server.url) as r:  # no other client
        s = keys.experience
        p = StreamProducer(r, s)
        for i in range(6):
            p.add(item(i))
        c = StreamConsumer(r, keys, s, ITEM, count=2, block_ms=0, claim_idle_ms=3_600_000)
        c.ack(c.read())  # (the server loads the scripts at their first run)
        first = c.read()
        c.defer_ack(first)
        assert r.xpending(s, GROUP)["pending"] == 2 and r.xlen(s) == 4  # not yet
        before = reads_of(r)
        second = c.read()
        assert reads_of(r) - before == 2  # the read with the acknowledgements, and INFO
        assert [e.data["seq"] for e in first + second] == [2, 3, 4, 5]
        assert r.xpending(s, GROUP)["pending"] == 2 and r.xlen(s) == 2  # the first two gone
        c.defer_ack(second[:1])
        before = reads_of(r)
        c.ack(second[1:])  # the deferred one with them
        assert reads_of(r) - before == 2 and r.xlen(s) == 0
        before = reads_of(r)
        c.ack()  # nothing deferred: no round trip
        assert reads_of(r) - before == 1
        p.add(item(6))
        c.defer_ack(c.read())
        c.close()  # acknowledges what was deferred before it leaves the group
        assert r.xlen(s) == 0 and r.xinfo_groups(s)[0]["consumers"] == 0


def test_a_deferred_acknowledgement_of_a_replaced_stream_does_not_fail_the_read(r, keys, caplog):
    """A writer may replace the stream by a key of another type: the entries whose
    acknowledgement was deferred are gone with it (one warning), and the read that carried
    it still reads (the stream made again)."""
    s = keys.experience
    p = StreamProducer(r, s)
    p.add(item(0))
    p.add(item(1))
    c = StreamConsumer(r, keys, s, ITEM, count=1, block_ms=0)
    c.ack(c.read())  # (the server loads the scripts at their first run)
    c.defer_ack(c.read())
    r.delete(s)
    r.set(s, "a writer's junk")
    with caplog.at_level(logging.WARNING, logger="qrl.wire.streams"):
        assert c.read() == []
    assert "entries are lost" in caplog.text
    p.add(item(2))
    assert [e.data["seq"] for e in c.read()] == [2]


def test_producer_counts_every_entry_it_added_in_the_run_stats(r, keys):
    p = StreamProducer(r, keys.experience, maxlen=3, keys=keys, max_wait=0.2)
    for i in range(3):
        p.add(item(i))
    assert p.add(item(3)) == ""  # dropped: not added, not counted as produced
    assert int(r.hget(keys.stats, "produced:experience")) == 3 == r.xlen(keys.experience)


def test_dead_letters_keep_a_bounded_prefix_of_the_payload(r, keys):
    from qrl.wire.stream_scripts import DEADLETTER_MAX_PAYLOAD, dead_letter

    big = b"x" * (1 << 20)
    dead_letter(r, keys, "experience", "too big to keep", big, "1-0")
    [(_, fields)] = r.xrange(keys.deadletter)
    assert fields[b"payload"] == big[:DEADLETTER_MAX_PAYLOAD] and DEADLETTER_MAX_PAYLOAD <= 4096
    assert fields[b"size"] == str(len(big)).encode() and fields[b"reason"] == b"too big to keep"


@pytest.mark.slow
def test_an_entry_that_kills_its_consumer_is_dead_lettered_after_n_deliveries(r, keys):
    p = StreamProducer(r, keys.experience)
    for i in range(4):
        p.add(item(i))  # seq 0 kills whoever handles it
    codes = []
    for _ in range(8):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "_poisoned_consumer.py"), url_of(r), keys.run],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            timeout=60,
        )
        codes.append(proc.returncode)
        if proc.returncode == 0:
            break
    assert codes == [-9] * 5 + [0], codes  # 5 deliveries (the default), then dead-lettered
    [(_, dead)] = r.xrange(keys.deadletter)
    assert b"delivered 6 times" in dead[b"reason"] and dead[b"payload"] == item(0)
    assert [int(x) for x in r.lrange(keys.prefix + "test:done", 0, -1)] == [1, 2, 3]
    assert r.xlen(keys.experience) == 0 and r.xpending(keys.experience, GROUP)["pending"] == 0
    assert r.xinfo_consumers(keys.experience, GROUP) == []  # it left the group at the end


def test_a_handler_that_keeps_failing_stops_getting_the_entry(r, keys):
    p = StreamProducer(r, keys.experience)
    for i in range(2):
        p.add(item(i))

    def handler(entries):
        if any(e.data["seq"] == 0 for e in entries):
            raise RuntimeError("cannot handle this one")
        got.extend(e.data["seq"] for e in entries)

    got: list[int] = []
    failures = 0
    for _ in range(10):  # a restarted role each time, same consumer name
        c = StreamConsumer(
            r, keys, keys.experience, ITEM, consumer="c", count=1, max_deliveries=3, block_ms=10
        )
        try:
            while c.process(handler):
                pass
            break
        except RuntimeError:
            failures += 1
    assert failures == 3 and got == [1] and c.rejected == 1
    [(_, dead)] = r.xrange(keys.deadletter)
    assert dead[b"reason"].startswith(b"poison: delivered 4 times")


def test_held_entries_do_not_age_into_poison(r, keys):
    """What a consumer holds (assembling a batch) is kept fresh without counting a delivery,
    so its own claim scans never push it past ``max_deliveries``."""
    StreamProducer(r, keys.experience).add(item(0))
    c = StreamConsumer(r, keys, keys.experience, ITEM, claim_idle_ms=20, block_ms=10)
    held = c.read()
    for _ in range(10):  # each time idle enough to be claimed, then a claim scan of its own
        _idle_past(r, keys.experience, 20)
        c._next_claim = 0.0
        assert c.read() == []
    [row] = r.xpending_range(keys.experience, GROUP, "-", "+", 10)
    assert row["times_delivered"] == 1 and row["consumer"] == c.consumer.encode()
    c.ack(held)


def test_consumers_leave_the_group_when_they_close(r, keys):
    from qrl.algos.apex.config import ApexConfig
    from qrl.replay.role import ReplayFiller

    for _ in range(3):  # three restarts of a replay role
        filler = ReplayFiller(r, keys, ApexConfig())
        filler.consumer.consumer = f"replay-{_}"
        filler.step(lambda: False)
        filler.close(lambda: False)
    assert r.xinfo_consumers(keys.experience, GROUP) == []
    # a consumer that still holds entries stays (its entries must remain claimable) ...
    StreamProducer(r, keys.experience).add(item(0))
    holder = StreamConsumer(r, keys, keys.experience, ITEM, consumer="holder", block_ms=10)
    assert len(holder.read()) == 1
    holder.close()
    assert [c["name"] for c in r.xinfo_consumers(keys.experience, GROUP)] == [b"holder"]
    # ... until another consumer has claimed them; then its claim scans remove the empty one
    other = StreamConsumer(r, keys, keys.experience, ITEM, claim_idle_ms=20, block_ms=10)
    _idle_past(r, keys.experience, 20)
    assert len(other.read()) == 1
    _consumer_idle_past(r, keys.experience, "holder", 20)
    other._next_claim = 0.0
    other.read()
    assert [c["name"] for c in r.xinfo_consumers(keys.experience, GROUP)] == [
        other.consumer.encode()
    ]


def _streams(keys, n: int) -> list[str]:
    return [keys.key(f"test:writer:{w}") for w in range(n)]


def test_a_consumer_of_several_streams_takes_them_in_turn_and_knows_whose(r, keys):
    """One stream per writer: a writer whose stream holds 50 gets no more of a read than
    one whose stream holds 5 while both have some; each entry names its stream, and acks,
    a restarted consumer's re-read and a survivor's claims go stream by stream."""
    flood, few = _streams(keys, 2)
    for i in range(50):
        r.xadd(flood, {"d": item(i)})
    for i in range(5):
        r.xadd(few, {"d": item(100 + i)})
    c = StreamConsumer(r, keys, [flood, few], ITEM, count=10, block_ms=10)
    first = c.read()
    assert sorted(e.data["seq"] for e in first if e.stream == few) == list(range(100, 105))
    assert sorted(e.data["seq"] for e in first if e.stream == flood) == list(range(5))
    c.ack(first)
    assert r.xlen(few) == 0 and r.xlen(flood) == 45
    held = c.read()  # now the flood's alone
    assert [e.data["seq"] for e in held] == list(range(5, 15))
    r.xadd(few, {"d": item(105)})
    held += c.read(count=2)
    assert [e.stream for e in held[-2:]].count(few) == 1  # its turn comes at once
    # the same name, restarted, re-reads what it held of each stream, once
    again = StreamConsumer(r, keys, [flood, few], ITEM, consumer=c.consumer, block_ms=10)
    got = again.read(count=100) + again.read(count=100)
    assert sorted((e.stream, e.id) for e in got) == sorted((e.stream, e.id) for e in held)
    # a survivor claims them from the dead consumer, stream by stream
    survivor = StreamConsumer(r, keys, [flood, few], ITEM, claim_idle_ms=0, block_ms=10)
    claimed: list = []
    for _ in range(10):
        claimed += (got := survivor.read(count=100))
        survivor.ack(got)
    assert len(claimed) == len({e.id for e in claimed}) == len(held) + 34  # each once
    assert r.xlen(flood) == r.xlen(few) == 0
