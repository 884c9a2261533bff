"""Redis streams: a producer with backpressure and a consumer-group reader.

Delivery contract (``DESIGN.md``):

* A producer adds an entry only while fewer than ``maxlen`` entries wait undelivered (an
  atomic Lua check-and-XADD); otherwise it backs off and retries. It never trims, so nothing
  is silently dropped: the cap bounds memory by making producers wait. Entries already
  delivered but not yet acknowledged (a consumer assembling a batch) do not count, so a
  consumer that needs more than ``maxlen`` entries for one batch still gets them.
* A consumer reads through the consumer group ``qrl``, acknowledges an entry only after its
  handler succeeded, and then deletes it (XACK + XDEL in one transaction), so the stream's
  length is exactly the work not yet done.
* Entries left pending by a dead consumer are claimed (XAUTOCLAIM) once idle for
  ``claim_idle_ms``; a restarted consumer with the same name first re-reads its own pending
  entries, once each. Entries a consumer still holds are never handed to it a second time.
* An entry that fails to decode is moved to the run's dead-letter stream with the reason,
  counted in the run's stats hash, and acknowledged; the consumer keeps running.
* A poison entry, one delivered more than ``max_deliveries`` times without being
  acknowledged (whatever failed: a handler that raised, a consumer killed by it), is
  dead-lettered the same way instead of being handed out again.
* A consumer that closes with nothing pending leaves the group; consumers that hold nothing
  and were idle for ``claim_idle_ms`` are removed too, so the group does not grow with every
  restart.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from qrl.codec import CodecError, Schema, decode
from qrl.keys import RunKeys

log = logging.getLogger(__name__)

GROUP = "qrl"
FIELD = b"d"  # an entry's one field: the encoded payload
DEADLETTER_MAXLEN = 10_000
DEADLETTER_MAX_PAYLOAD = 4096  # bytes of a rejected payload kept (its full size is recorded):
# 10,000 entries x 4 KiB bounds the dead-letter stream to ~40 MiB

_ADD_IF_ROOM = """
-- entries waiting = in the stream and not yet delivered to a consumer (XLEN - pending):
-- what consumers hold while assembling a batch must not count, or they could wait forever
local waiting = redis.call('XLEN', KEYS[1])
local pending = redis.pcall('XPENDING', KEYS[1], 'qrl')
if type(pending) == 'table' and pending.err == nil then waiting = waiting - pending[1] end
if waiting >= tonumber(ARGV[1]) then return false end
local id = redis.call('XADD', KEYS[1], '*', 'd', ARGV[2])
-- count every entry ever added, in the same step (the run's stats hash, if given)
if KEYS[2] then redis.call('HINCRBY', KEYS[2], ARGV[3], 1) end
return id
"""

_LEAVE = """
-- remove consumer ARGV[2] from group ARGV[1] unless it still holds entries (they would be lost)
local held = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #held > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2]) + 1
"""


class StreamFull(TimeoutError):
    """The stream stayed full for longer than the producer's ``max_wait``."""


def _consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class StreamProducer:
    """Adds encoded payloads to ``stream``, waiting (with backoff) while it holds ``maxlen``
    entries. ``waited_s`` accumulates the time spent waiting, a measure of backpressure.
    With ``keys``, every entry added is also counted, atomically with the XADD, in the
    run's stats hash under ``produced:SOURCE`` (e.g. ``produced:experience``)."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        maxlen: int = 1000,
        *,
        keys: RunKeys | None = None,
        max_wait: float | None = None,
        max_delay: float = 0.5,
    ) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be >= 1")
        self.client = client
        self.stream = stream
        self.maxlen = maxlen
        self.max_wait = max_wait
        self.max_delay = max_delay
        self.waited_s = 0.0
        self._script = client.register_script(_ADD_IF_ROOM)
        self._keys = [stream] if keys is None else [stream, keys.stats]
        self._counter = [] if keys is None else [f"produced:{stream.removeprefix(keys.prefix)}"]

    def add(self, payload: bytes, should_stop: Callable[[], bool] | None = None) -> str | None:
        """Add one payload; returns its entry id. Blocks while the stream is full; returns
        ``None`` without adding if ``should_stop()`` becomes true while waiting, raises
        :class:`StreamFull` after ``max_wait`` seconds."""
        delay = 0.001
        start = time.monotonic()
        while True:
            entry_id = self._script(keys=self._keys, args=[self.maxlen, payload, *self._counter])
            if entry_id is not None:
                return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            waited = time.monotonic() - start
            if self.max_wait is not None and waited > self.max_wait:
                raise StreamFull(f"{self.stream} stayed full ({self.maxlen}) for {waited:.1f}s")
            if should_stop is not None and should_stop():
                return None
            time.sleep(delay)
            self.waited_s += delay
            delay = min(delay * 2, self.max_delay)


@dataclass
class Entry:
    """A decoded stream entry."""

    id: str
    data: dict[str, Any]


def dead_letter(
    pipe: redis.client.Pipeline | redis.Redis,
    keys: RunKeys,
    source: str,
    reason: str,
    payload: bytes | None,
    entry_id: str = "",
) -> None:
    """Record a rejected payload with its reason in the run's dead-letter stream (capped)
    and count it in the run's stats hash under ``rejected`` and ``rejected:SOURCE``."""
    payload = payload or b""
    fields = {
        "source": source,
        "id": entry_id,
        "reason": reason[:1000],
        "time": f"{time.time():.3f}",
        "size": str(len(payload)),
        "payload": payload[:DEADLETTER_MAX_PAYLOAD],
    }
    pipe.xadd(keys.deadletter, fields, maxlen=DEADLETTER_MAXLEN, approximate=True)
    pipe.hincrby(keys.stats, "rejected", 1)
    pipe.hincrby(keys.stats, f"rejected:{source}", 1)


class StreamConsumer:
    """Reads ``stream`` through the consumer group ``qrl`` and decodes with ``schema``.

    Use :meth:`read` then :meth:`ack`, or :meth:`process` with a handler, and :meth:`close`
    at the end. Undecodable entries, and entries delivered more than ``max_deliveries``
    times, never reach the caller: they are dead-lettered and acknowledged. Payloads are
    decoded with at most ``max_bytes`` (default: the schema's cap).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        stream: str,
        schema: Schema,
        *,
        consumer: str | None = None,
        count: int = 16,
        block_ms: int = 1000,
        claim_idle_ms: int = 30_000,
        max_bytes: int | None = None,
        max_deliveries: int = 5,
    ) -> None:
        self.client = client
        self.keys = keys
        self.stream = stream
        self.source = stream.removeprefix(keys.prefix)
        self.schema = schema
        self.consumer = consumer or _consumer_name()
        self.count = count
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_bytes = max_bytes
        self.max_deliveries = max_deliveries
        self.rejected = 0
        self._own_pending: str | None = "0"  # cursor through what this name left pending
        self._held: set[str] = set()  # delivered to us, not yet acknowledged
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._leave = client.register_script(_LEAVE)
        ensure_group(client, stream)

    # -- reading
    def _poison(self, ids: list[str]) -> dict[str, str]:
        """Why each of ``ids`` (re-delivered entries) is poison, if it was delivered more
        than ``max_deliveries`` times."""
        if not ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for i in ids:
            pipe.xpending_range(self.stream, GROUP, min=i, max=i, count=1)
        out = {}
        for i, rows in zip(ids, pipe.execute(), strict=True):
            n = rows[0]["times_delivered"] if rows else 0
            if n > self.max_deliveries:
                out[i] = (
                    f"poison: delivered {n} times without being acknowledged "
                    f"(more than {self.max_deliveries}: its consumers failed or died on it)"
                )
        return out

    def _decode(
        self, raw: Sequence[tuple[Any, dict[bytes, bytes] | None]], redelivered: bool = False
    ) -> list[Entry]:
        good: list[Entry] = []
        bad: list[tuple[str, str, bytes | None]] = []
        ids = [i.decode() if isinstance(i, bytes) else i for i, _ in raw]
        poison = self._poison(ids) if redelivered else {}
        for eid, (_, fields) in zip(ids, raw, strict=True):
            if not fields:  # deleted while pending: nothing to deliver
                bad.append((eid, "", None))
                continue
            payload = fields.get(FIELD)
            try:
                if eid in poison:
                    raise CodecError(poison[eid])
                if payload is None or len(fields) != 1:
                    raise CodecError(f"entry fields must be exactly [{FIELD.decode()}]")
                good.append(Entry(eid, decode(payload, self.schema, max_bytes=self.max_bytes)))
            except CodecError as e:
                bad.append((eid, str(e), payload))
        if bad:
            pipe = self.client.pipeline(transaction=True)
            for eid, reason, payload in bad:
                if reason:
                    log.warning("rejected %s entry %s: %s", self.source, eid, reason)
                    dead_letter(pipe, self.keys, self.source, reason, payload, eid)
                    self.rejected += 1
                pipe.xack(self.stream, GROUP, eid)
                pipe.xdel(self.stream, eid)
            pipe.execute()
        return good

    def _take(
        self, raw: Sequence[tuple[Any, dict[bytes, bytes] | None]], redelivered: bool = False
    ) -> list[Entry]:
        """Decode entries newly delivered to us (skipping any we already hold)."""
        ids = [i.decode() if isinstance(i, bytes) else i for i, _ in raw]
        fresh = [e for e, i in zip(raw, ids, strict=True) if i not in self._held]
        good = self._decode(fresh, redelivered)
        self._held.update(e.id for e in good)
        return good

    def read(self, block_ms: int | None = None) -> list[Entry]:
        """Up to ``count`` decoded entries: first this consumer's own pending entries (after
        a restart), then entries claimed from dead consumers, then new ones (blocking up to
        ``block_ms``). Returns an empty list when there is nothing to do."""
        while self._own_pending is not None:
            resp = self.client.xreadgroup(
                GROUP, self.consumer, {self.stream: self._own_pending}, count=self.count
            )
            raw = resp[0][1] if resp else []
            if not raw:
                self._own_pending = None
                break
            last = raw[-1][0]
            self._own_pending = last.decode() if isinstance(last, bytes) else last
            good = self._take(raw, redelivered=True)
            if good:
                return good
        now = time.monotonic()
        if now >= self._next_claim:
            if self._held:  # keep what we hold from going idle (JUSTID: no delivery counted)
                self.client.xclaim(
                    self.stream, GROUP, self.consumer, 0, sorted(self._held), justid=True
                )
            _cursor, raw, *_ = self.client.xautoclaim(
                self.stream,
                GROUP,
                self.consumer,
                min_idle_time=self.claim_idle_ms,
                start_id=self._claim_cursor,
                count=self.count,
            )
            self._claim_cursor = _cursor.decode() if isinstance(_cursor, bytes) else _cursor
            if self._claim_cursor == "0-0":  # scanned the whole pending list
                self._next_claim = now + max(self.claim_idle_ms / 4000, 0.05)
                self._prune()
            good = self._take(raw, redelivered=True)
            if good:
                log.info("claimed %d pending %s entries", len(good), self.source)
                return good
        block = self.block_ms if block_ms is None else block_ms
        resp = self.client.xreadgroup(
            GROUP, self.consumer, {self.stream: ">"}, count=self.count, block=block or None
        )
        return self._take(resp[0][1]) if resp else []

    def ack(self, entries: Sequence[Entry]) -> None:
        """Acknowledge and delete ``entries`` (one transaction)."""
        if not entries:
            return
        ids = [e.id for e in entries]
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.stream, GROUP, *ids)
        pipe.xdel(self.stream, *ids)
        pipe.execute()
        self._held.difference_update(ids)

    def release(self, entries: Sequence[Entry]) -> None:
        """Give up ``entries`` without acknowledging: they stay pending and can be claimed
        again (by any consumer, this one included) once idle."""
        self._held.difference_update(e.id for e in entries)

    def _prune(self) -> None:
        """Remove consumers that hold nothing and were idle for ``claim_idle_ms``."""
        for c in self.client.xinfo_consumers(self.stream, GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name != self.consumer and not c["pending"] and c["idle"] > self.claim_idle_ms:
                self._leave(keys=[self.stream], args=[GROUP, name])

    def close(self) -> None:
        """Leave the group, unless entries are still pending for this consumer (then they
        stay claimable by others). Best effort: Redis may already be gone."""
        try:
            self._leave(keys=[self.stream], args=[GROUP, self.consumer])
        except redis.RedisError as e:
            log.debug("could not leave the %s group: %s", self.source, e)

    def process(self, handler: Callable[[list[Entry]], None], block_ms: int | None = None) -> int:
        """Read a batch, pass it to ``handler`` and acknowledge it only if the handler
        returned. Returns the number of entries handled."""
        entries = self.read(block_ms)
        if entries:
            try:
                handler(entries)
            except BaseException:
                self.release(entries)
                raise
            self.ack(entries)
        return len(entries)


def ensure_group(client: redis.Redis, stream: str) -> None:
    """Create the consumer group ``qrl`` on ``stream`` (and the stream) if missing."""
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
