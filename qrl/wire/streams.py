"""Redis streams: a producer with backpressure and a consumer-group reader.

Delivery contract (README.md, "The contracts", says the same for users):

* A producer adds an entry only while fewer than ``maxlen`` entries wait undelivered (an
  atomic Lua check-and-XADD); otherwise it backs off and retries, for at most ``max_wait``
  seconds: then it drops that payload (one warning, counted as ``dropped:SOURCE`` in the
  run's stats) and goes on, so entries added past the room check (or Redis out of memory)
  never block it for good. It never trims: the cap bounds memory by making producers wait.
  Entries delivered but not yet acknowledged (a consumer assembling a batch) do not count.
* A consumer reads through the consumer group ``qrl``, acknowledges an entry only after its
  handler succeeded, and then deletes it (XACK + XDEL in one step), so the stream's length
  is exactly the work not yet done.
* A Lua script reads entries one at a time and measures each inside Redis: one larger than
  a payload under the schema's cap can be is acknowledged and deleted there, unread, and
  dead-lettered by its size. A read examines at most ``count`` entries and stops after
  about ``count`` x cap bytes: bounded work for Redis and for the consumer. After a read
  that found only entries to reject it examines more (up to ``SCAN_MAX``, in the same bytes)
  and keeps good entries past ``count`` for the next: a flood of junk is rejected a batch
  at a time, its dead letters and acknowledgements in one round trip.
* Entries left pending by a dead consumer are claimed (XAUTOCLAIM) once idle for
  ``claim_idle_ms``; a restarted consumer with the same name first re-reads its own pending
  entries, once each. Entries a consumer still holds are never handed to it a second time.
* An entry that fails to decode, or was delivered more than ``max_deliveries`` times
  without being acknowledged (a handler that raised, a consumer killed by it), is moved to
  the run's dead-letter stream with the reason, counted in the run's stats, and acknowledged.
* A consumer that closes with nothing pending leaves the group; consumers that hold nothing
  and were idle for ``claim_idle_ms`` are removed too (at most ``PRUNE_MAX`` a cycle).
* Anyone with the run's keys can write anything: a key of the wrong type where the stream,
  the dead letters or the stats belong is deleted (one warning) and recreated, so is a
  destroyed group, and a stream whose ids were used up; entries the group was made to skip
  (XGROUP SETID) are claimed and handed out. Dead letters and counters are optional
  writes: when Redis refuses them (out of memory) entries are still acknowledged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from qrl.wire import clock, faults
from qrl.wire import stream_scripts as lua
from qrl.wire.cluster import run_scripts
from qrl.wire.codec import CodecError, Schema, decode
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import Lua
from qrl.wire.stream_scripts import dead_letter_call, optional, stored_cap, text, warn_once

log = logging.getLogger(__name__)

GROUP = "qrl"
FIELD = b"d"  # an entry's one field: the encoded payload
PRUNE_MAX = 10_000  # idle consumers removed per claim cycle (each is O(1) in Redis)
SCAN_MAX = 256  # entries one read examines after reads that found only entries to reject
MAX_WAIT = 60.0  # seconds a producer waits for room before it drops the payload

# the scripts (qrl/wire/lua/streams.*.lua): a producer's check-and-XADD; a consumer's group,
# reads (its own pending entries, claims, new ones), orphans' adoption, acknowledgement and
# leaving; the dead letters' are lua.DEAD_LETTER_LUA
ADD_IF_ROOM = Lua("streams.add_if_room", *lua.REPAIRS, "streams.add_if_room")
ENSURE_GROUP = Lua("streams.ensure_group", "streams.fix", "streams.ensure_group")
READ = Lua("streams.read", constants={"MAX_ENTRIES": lua.MAX_ENTRIES})
ADOPT = Lua("streams.adopt", constants={"MAX_ENTRIES": lua.MAX_ENTRIES})
ACK = Lua("streams.ack")
LEAVE = Lua("streams.leave")

Rejected = tuple[str, str, bytes | None, int | None]  # an entry's id, why, payload, size


def _consumer_name() -> str:
    """This process's name in a group; a thread's other than the main one (the roles of a
    one-process run, :mod:`qrl.runtime.turns`) adds its own, so no two share one."""
    name = f"{socket.gethostname()}-{os.getpid()}"
    thread = threading.current_thread()
    return name if thread is threading.main_thread() else f"{name}-{thread.name}"


class StreamProducer:
    """Adds encoded payloads to ``stream``, waiting (with backoff) while it holds ``maxlen``
    entries, at most ``max_wait`` seconds per payload (then it is dropped and counted in
    ``dropped``). ``waited_s`` accumulates the time spent waiting, a measure of
    backpressure. With ``keys``, every entry added is also counted, atomically with the
    XADD, in the run's stats hash under ``produced:SOURCE`` (e.g. ``produced:experience``)."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        maxlen: int = 1000,
        *,
        keys: RunKeys | None = None,
        max_wait: float = MAX_WAIT,
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
        self.dropped = 0
        self._script = ADD_IF_ROOM.on(client)
        self._keys = [stream] if keys is None else [stream, keys.stats]
        self._source = stream if keys is None else stream.removeprefix(keys.prefix)
        self._counter = [] if keys is None else [f"produced:{self._source}"]

    def _try(self, payload: bytes) -> str | None:
        """Add ``payload`` if there is room: its entry id, or ``None`` (no room, or Redis
        out of memory: both pass when the consumers catch up)."""
        args = [self.maxlen, payload, *self._counter]
        entry_id, *notes = optional(self.stream, lambda: self._script(self._keys, args)) or [None]
        warn_once(*notes)
        return None if entry_id is None else text(entry_id)

    def add(self, payload: bytes, should_stop: Callable[[], bool] | None = None) -> str | None:
        """Add one payload; returns its entry id. Waits while the stream is full; returns
        ``None`` without adding if ``should_stop()`` becomes true while waiting, and ``""``
        (dropped, counted, logged) after ``max_wait`` seconds."""
        delay = 0.001
        start = clock.now()
        while (entry_id := self._try(payload)) is None:
            waited = clock.now() - start
            if waited > self.max_wait:
                return self._drop()
            if should_stop is not None and should_stop():
                return None
            clock.sleep(delay)
            self.waited_s += delay
            delay = min(delay * 2, self.max_delay)
        return entry_id

    def _drop(self) -> str:
        self.dropped += 1
        warn_once(
            f"{self.stream} stayed full ({self.maxlen} waiting) for {self.max_wait:.0f}s: "
            "dropped a payload and went on (a stalled consumer, entries added past the room "
            f"check, or Redis out of memory); counted as dropped:{self._source} in the stats"
        )
        if len(self._keys) > 1:  # a counter only: skipped if Redis refuses it
            counter = f"dropped:{self._source}"
            with contextlib.suppress(redis.ResponseError):
                optional(counter, lambda: self.client.hincrby(self._keys[1], counter, 1))
        return ""


@dataclass
class Entry:
    """A decoded stream entry."""

    id: str
    data: dict[str, Any]


class StreamConsumer:
    """Reads ``stream`` through the consumer group ``qrl`` and decodes with ``schema``.

    Use :meth:`read` then :meth:`ack`, or :meth:`process` with a handler, and :meth:`close`
    at the end. Undecodable entries, entries larger than a payload of ``max_bytes`` can be
    (default: the schema's cap), and entries delivered more than ``max_deliveries`` times
    never reach the caller: they are dead-lettered and acknowledged.
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
        self._orphan_cursor = "-"
        self._next_claim = 0.0
        self._widen = 1  # reads that found nothing but rejects examine more entries at once
        self._ahead: list[Entry] = []  # good entries such a read found past the count asked
        self._adopt = ADOPT.on(client)
        self._dead = lua.DEAD_LETTER_LUA.on(client)
        self._read = READ.on(client)
        self._leave = LEAVE.on(client)
        self._ack = ACK.on(client)
        ensure_group(client, stream)

    def _reject(self, rejected: list[Rejected], ack: list[str]) -> None:
        """Dead-letter the ``(id, reason, payload, size)`` of ``rejected`` and acknowledge (and
        delete) the entries ``ack``, in one round trip for them all, not one per entry;
        acknowledged whether or not the dead letters could be written. Logged once per
        reason: the dead letters keep every one."""
        calls = [(self._ack, [self.stream], ack)] if ack else []
        for eid, reason, payload, size in rejected:
            faults.warn_once(
                f"{self.source}: {reason}", "rejected %s entry %s: %s", self.source, eid, reason,
                kind="rejected entries", logger=log,
            )  # fmt: skip
            calls.append(
                (self._dead, *dead_letter_call(self.keys, self.source, reason, payload, eid, size))
            )
        self.rejected += len(rejected)
        replies = optional(
            f"dead letters of {self.stream}", lambda: run_scripts(self.client, calls)
        )
        for notes in (replies or [])[1 if ack else 0 :]:
            warn_once(*notes)

    def _decode(
        self, raw: Sequence[tuple[str, dict[bytes, bytes] | None, int]]
    ) -> tuple[list[Entry], list[Rejected], list[str]]:
        """The entries of ``raw`` that decode; those that do not, with why; the ids of both
        those and the entries deleted while pending (to acknowledge)."""
        good: list[Entry] = []
        rejected: list[Rejected] = []
        bad: list[str] = []
        for eid, fields, delivered in raw:
            if not fields:  # deleted while pending: nothing to deliver
                bad.append(eid)
                continue
            payload = fields.get(FIELD)
            try:
                if delivered > self.max_deliveries:
                    raise CodecError(
                        f"poison: delivered {delivered} times without being acknowledged "
                        f"(more than {self.max_deliveries}: its consumers failed or died on it)"
                    )
                if payload is None or len(fields) != 1:
                    raise CodecError(f"entry fields must be exactly [{FIELD.decode()}]")
                good.append(Entry(eid, decode(payload, self.schema, max_bytes=self.max_bytes)))
            except CodecError as e:
                rejected.append((eid, str(e), payload, None))
                bad.append(eid)
        return good, rejected, bad

    @property
    def _cap(self) -> int:
        return stored_cap(self.schema.max_bytes if self.max_bytes is None else self.max_bytes)

    def _fetch(
        self, mode: str, cursor: str = "", count: int | None = None, scan: int | None = None
    ) -> tuple[str | None, list[Entry], bool]:
        """One call of the read script (``qrl/wire/lua/streams.read.lua``), examining up to
        ``scan`` (default ``count``) entries and about ``count`` x cap bytes: the next cursor,
        the good entries newly delivered to us (skipping any we already hold), and whether
        any entry came at all."""
        cap, count = self._cap, count or self.count
        args = [self.consumer, mode, cursor, scan or count, cap, self.claim_idle_ms, count * cap]
        nxt, rows = self._read(keys=[self.stream], args=args)
        raw, oversized = [], []
        for eid, body, *delivered in ((text(row[0]), *row[1:]) for row in rows):
            if isinstance(body, int):  # acknowledged and deleted unread by the script
                reason = f"entry of {body} bytes is over the {cap} bytes a payload may take"
                oversized.append((eid, reason, None, body))
            elif eid not in self._held:
                fields = dict(zip(body[::2], body[1::2], strict=True)) if body else None
                raw.append((eid, fields, delivered[0] if delivered else 1))
        good, rejected, bad = self._decode(raw)
        if oversized or bad:
            self._reject(oversized + rejected, bad)
        self._held.update(e.id for e in good)
        return (None if nxt is None else text(nxt)), good, bool(rows)

    def read(self, block_ms: int | None = None, count: int | None = None) -> list[Entry]:
        """Up to ``count`` (default the consumer's) decoded entries: first this consumer's
        own pending entries (after a restart), then entries claimed from dead consumers, then
        new ones (waiting up to ``block_ms``). Returns an empty list when there is nothing
        to do."""
        if self._ahead:
            n = count or self.count
            out, self._ahead = self._ahead[:n], self._ahead[n:]
            return out
        try:
            return self._read_once(self.block_ms if block_ms is None else block_ms, count)
        except redis.ResponseError as e:  # the stream or group replaced or destroyed
            if "WRONGTYPE" not in str(e) and "NOGROUP" not in str(e):
                raise
            warn_once(f"{self.stream}: {e}; recreating the stream's group")
            ensure_group(self.client, self.stream)
            return []

    def _read_once(self, block_ms: int, count: int | None) -> list[Entry]:
        while self._own_pending is not None:
            self._own_pending, good, _ = self._fetch("own", self._own_pending, count)
            if good:
                return good
        now = clock.now()
        if now >= self._next_claim:
            if self._held:  # keep what we hold from going idle (JUSTID: no delivery counted)
                self.client.xclaim(
                    self.stream, GROUP, self.consumer, 0, sorted(self._held), justid=True
                )
            cursor, good, _ = self._fetch("claim", self._claim_cursor, count)
            self._claim_cursor = cursor or "0-0"
            if self._claim_cursor == "0-0":  # scanned the whole pending list
                self._next_claim = now + max(self.claim_idle_ms / 4000, 0.05)
                self._prune()
                self._claim_orphans()
            if good:
                log.info("claimed %d pending %s entries", len(good), self.source)
                return good
        # scripts cannot block: poll, backing off up to 20 ms, until block_ms has passed
        deadline, delay, want = now + block_ms / 1000, 0.002, count or self.count
        while True:
            scan = max(want, min(want * self._widen, SCAN_MAX))
            _, good, came = self._fetch(">", count=want, scan=scan)
            self._widen = min(self._widen * 4, SCAN_MAX) if came and not good else 1
            if good:
                self._ahead = good[want:]
                return good[:want]
            left = deadline - clock.now()
            if left <= 0:
                return []
            if not came:
                clock.sleep(min(delay, left))
                delay = min(delay * 2, 0.02)

    def ack(self, entries: Sequence[Entry]) -> None:
        """Acknowledge and delete ``entries`` (in one step)."""
        if not entries:
            return
        ids = [e.id for e in entries]
        try:
            self._ack(keys=[self.stream], args=ids)
        except redis.ResponseError as e:  # the stream replaced by another type: gone anyway
            if "WRONGTYPE" not in str(e):
                raise
            warn_once(f"{self.stream}: {e}; its entries are lost")
        self._held.difference_update(ids)

    def release(self, entries: Sequence[Entry]) -> None:
        """Give up ``entries`` without acknowledging: they stay pending and can be claimed
        again (by any consumer, this one included) once idle."""
        self._held.difference_update(e.id for e in entries)

    def _prune(self) -> None:
        """Remove up to ``PRUNE_MAX`` consumers that hold nothing and were idle for
        ``claim_idle_ms``, in one script call (the listing is one command)."""
        idle = [
            c["name"]
            for c in self.client.xinfo_consumers(self.stream, GROUP)
            if not c["pending"] and c["idle"] > self.claim_idle_ms
        ]
        idle = [n for n in idle if text(n) != self.consumer][:PRUNE_MAX]
        if idle:
            self._leave(keys=[self.stream], args=[GROUP, *idle])

    def _claim_orphans(self) -> None:
        """Claim entries nobody would be handed (``qrl/wire/lua/streams.adopt.lua``) and
        scan the pending entries again at once, which hands them out."""
        args = [self.consumer, self._orphan_cursor, self.count, self._cap, self.claim_idle_ms]
        cursor, n = self._adopt(keys=[self.stream], args=args)
        self._orphan_cursor = text(cursor)
        if n:
            warn_once(f"{self.stream}: entries no consumer held or would be handed: claimed")
            self._next_claim = 0.0

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
    """Create the consumer group ``qrl`` on ``stream`` (and the stream) if missing; a key
    of another type in the stream's place is deleted first (one warning)."""
    warn_once(*ENSURE_GROUP(client, [stream]))
