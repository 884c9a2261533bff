"""Redis streams: a producer with backpressure and a consumer-group reader.

Delivery contract (docs/concepts.md, "Streams", says the same for users):

* A producer adds an entry only while fewer than ``maxlen`` entries wait undelivered (an
  atomic Lua check-and-XADD); otherwise it backs off and retries, for at most ``max_wait``
  seconds: then it drops that payload (one warning, counted as ``dropped:SOURCE`` in the
  run's stats) and goes on, so entries added past the room check (or Redis out of memory)
  never block it for good. It never trims: the cap bounds memory by making producers wait.
  Entries delivered but not yet acknowledged (a consumer assembling a batch) do not count.
* A consumer reads through the consumer group ``qrl``, acknowledges an entry only after its
  handler succeeded, and then deletes it (XACK + XDEL in one step), so the stream's length
  is exactly the work not yet done. Acknowledgements may ride on the consumer's next read,
  in its round trip (a reader far from Redis pays one round trip for both).
* A Lua script reads entries one at a time and measures each inside Redis: one larger than
  a payload under the schema's cap can be is acknowledged and deleted there, unread, and
  dead-lettered by its size. A read examines at most ``count`` entries and stops after
  about ``count`` x cap bytes: bounded work for Redis and for the consumer. After a read
  that found only entries to reject it examines more (up to ``SCAN_MAX``, in the same bytes)
  and keeps good entries past ``count`` for the next: a flood of junk is rejected a batch
  at a time, its dead letters and acknowledgements in one round trip.
* A consumer may read several streams, one per writer (a per-instance user writes its own
  only, so the stream says who wrote an entry): one read takes a new entry of each stream
  that has one, in turns, in one script call, starting at another stream each read, so a
  writer that floods its stream gets no more of a read than the others with entries
  waiting. A stream of them deleted, replaced or without its group is made again inside
  that call: its writer cannot hold the others' entries back.
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
READ = Lua(
    "streams.read", "streams.fix", "streams.read", constants={"MAX_ENTRIES": lua.MAX_ENTRIES}
)
ADOPT = Lua("streams.adopt", constants={"MAX_ENTRIES": lua.MAX_ENTRIES})
ACK = Lua("streams.ack")
LEAVE = Lua("streams.leave")


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
    """A decoded stream entry, and the stream it came from (a consumer may read several)."""

    id: str
    data: dict[str, Any]
    stream: str = ""


Held = tuple[str, str]  # an entry as a consumer holds it: its stream, its id
Rejected = tuple[str, str, str, bytes | None, int | None]  # stream, id, why, payload, size


def _broken(e: redis.ResponseError) -> bool:
    """Whether ``e`` says a stream was deleted, replaced by another type or lost its group
    (its writers may do that: the consumer makes it again and goes on)."""
    return any(s in str(e) for s in ("WRONGTYPE", "NOGROUP", "no such key"))


def _each(client: redis.Redis, calls: list[tuple[Any, list[str], list[Any]]]) -> None:
    """Script calls, one stream's each: one directly, more in one round trip."""
    if len(calls) == 1:
        script, keys, args = calls[0]
        script(keys, args)
    else:
        run_scripts(client, calls)


def _by_stream(held: Sequence[Held]) -> dict[str, list[str]]:
    """The ids of ``held``, stream by stream (in the order first met)."""
    out: dict[str, list[str]] = {}
    for stream, eid in held:
        out.setdefault(stream, []).append(eid)
    return out


class StreamConsumer:
    """Reads ``stream`` (or each of several streams: a list) through the consumer group
    ``qrl`` and decodes with ``schema``.

    Use :meth:`read` then :meth:`ack` (or :meth:`defer_ack`: with the next read), or
    :meth:`process` with a handler, and :meth:`close` at the end. Undecodable entries,
    entries larger than a payload of ``max_bytes`` can be (default: the schema's cap), and
    entries delivered more than ``max_deliveries`` times never reach the caller: they are
    dead-lettered and acknowledged.

    Of several streams (one per writer, each writable by its writer only, so an entry's
    stream names who wrote it: :attr:`Entry.stream`), one read takes new entries of every
    stream in turns, in one script call, starting at another stream each time: a writer
    that floods its stream gets no more of a read than the others with entries waiting.
    Pending entries are re-read and claimed stream by stream.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        stream: str | Sequence[str],
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
        self.streams = [stream] if isinstance(stream, str) else list(stream)
        if not self.streams:
            raise ValueError("a consumer needs a stream")
        more = len(self.streams) - 1
        self.name = self.streams[0] + (f" (and {more} more)" if more else "")  # in logs
        self.schema = schema
        self.consumer = consumer or _consumer_name()
        self.count = count
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_bytes = max_bytes
        self.max_deliveries = max_deliveries
        self.rejected = 0
        # per stream: the cursor through what this name left pending (None: done), the claim
        # scan's and the orphan scan's cursors
        self._own: dict[str, str | None] = dict.fromkeys(self.streams, "0")
        self._claim_cursor = dict.fromkeys(self.streams, "0-0")
        self._orphan_cursor = dict.fromkeys(self.streams, "-")
        self._claiming = 0  # the stream whose pending entries the claim scan is at
        self._turn = 0  # the stream a read of new entries asks first
        self._held: set[Held] = set()  # delivered to us, not yet acknowledged
        self._acking: list[Held] = []  # to acknowledge with the next round trip
        self._next_claim = 0.0
        self._widen = 1  # reads that found nothing but rejects examine more entries at once
        self._ahead: list[Entry] = []  # good entries such a read found past the count asked
        self._adopt = ADOPT.on(client)
        self._dead = lua.DEAD_LETTER_LUA.on(client)
        self._read = READ.on(client)
        self._leave = LEAVE.on(client)
        self._ack = ACK.on(client)
        self._ensure_groups()

    def source(self, stream: str) -> str:
        """``stream``'s name in the run's stats and dead letters (without the prefix)."""
        return stream.removeprefix(self.keys.prefix)

    def _ensure_groups(self) -> None:
        for stream in self.streams:
            ensure_group(self.client, stream)

    def _reject(self, rejected: list[Rejected], ack: list[Held]) -> None:
        """Dead-letter the ``(stream, id, reason, payload, size)`` of ``rejected`` and
        acknowledge (and delete) the entries ``ack``, in one round trip for them all, not one
        per entry; acknowledged whether or not the dead letters could be written. Logged once
        per reason: the dead letters keep every one."""
        calls = [(self._ack, [s], ids) for s, ids in _by_stream(ack).items()]
        acks = len(calls)
        for stream, eid, reason, payload, size in rejected:
            source = self.source(stream)
            faults.warn_once(
                f"{source}: {reason}",
                "rejected %s entry %s: %s",
                source,
                eid,
                reason,
                kind="rejected entries",
                logger=log,
            )
            calls.append(
                (self._dead, *dead_letter_call(self.keys, source, reason, payload, eid, size))
            )
        self.rejected += len(rejected)
        replies = optional(f"dead letters of {self.name}", lambda: run_scripts(self.client, calls))
        for notes in (replies or [])[acks:]:
            warn_once(*notes)

    def _decode(
        self, raw: Sequence[tuple[str, str, dict[bytes, bytes] | None, int]]
    ) -> tuple[list[Entry], list[Rejected], list[Held]]:
        """The entries of ``raw`` (stream, id, fields, times delivered) that decode; those
        that do not, with why; both those and the entries deleted while pending (to
        acknowledge)."""
        good: list[Entry] = []
        rejected: list[Rejected] = []
        bad: list[Held] = []
        for stream, eid, fields, delivered in raw:
            if not fields:  # deleted while pending: nothing to deliver
                bad.append((stream, eid))
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
                data = decode(payload, self.schema, max_bytes=self.max_bytes)
                good.append(Entry(eid, data, stream))
            except CodecError as e:
                rejected.append((stream, eid, str(e), payload, None))
                bad.append((stream, eid))
        return good, rejected, bad

    @property
    def _cap(self) -> int:
        return stored_cap(self.schema.max_bytes if self.max_bytes is None else self.max_bytes)

    def _fetch(
        self,
        mode: str,
        streams: list[str],
        cursor: str = "",
        count: int | None = None,
        scan: int | None = None,
    ) -> tuple[str | None, list[Entry], bool]:
        """One call of the read script (``qrl/wire/lua/streams.read.lua``) on ``streams``,
        examining up to ``scan`` (default ``count``) entries and about ``count`` x cap bytes:
        the next cursor, the good entries newly delivered to us (skipping any we already
        hold), and whether any entry came at all."""
        cap, count = self._cap, count or self.count
        args = [self.consumer, mode, cursor, scan or count, cap, self.claim_idle_ms, count * cap]
        nxt, rows, *notes = self._acked_with((self._read, streams, args))
        warn_once(*notes)
        raw, oversized = [], []
        for eid, body, delivered, k in ((text(row[0]), *row[1:]) for row in rows):
            stream = streams[k - 1]
            if isinstance(body, int):  # acknowledged and deleted unread by the script
                reason = f"entry of {body} bytes is over the {cap} bytes a payload may take"
                oversized.append((stream, eid, reason, None, body))
            elif (stream, eid) not in self._held:
                fields = dict(zip(body[::2], body[1::2], strict=True)) if body else None
                raw.append((stream, eid, fields, delivered))
        good, rejected, bad = self._decode(raw)
        if oversized or bad:
            self._reject(oversized + rejected, bad)
        self._held.update((e.stream, e.id) for e in good)
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
        except redis.ResponseError as e:  # a stream or group replaced or destroyed
            if not _broken(e):
                raise
            warn_once(f"{self.name}: {e}; recreating the stream's group")
            self._ensure_groups()
            return []

    def _read_once(self, block_ms: int, count: int | None) -> list[Entry]:
        for stream, cursor in self._own.items():
            while cursor is not None:
                cursor, good, _ = self._fetch("own", [stream], cursor, count)
                self._own[stream] = cursor
                if good:
                    return good
        now = clock.now()
        if now >= self._next_claim:
            good = self._claim_step(now, count)
            if good:
                return good
        # scripts cannot block: poll, backing off up to 20 ms, until block_ms has passed
        deadline, delay, want = now + block_ms / 1000, 0.002, count or self.count
        while True:
            scan = max(want, min(want * self._widen, SCAN_MAX))
            turn = self._turn = (self._turn + 1) % len(self.streams)
            streams = self.streams[turn:] + self.streams[:turn]
            _, good, came = self._fetch(">", streams, count=want, scan=scan)
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

    def _claim_step(self, now: float, count: int | None) -> list[Entry]:
        """One step of the claim scan: entries of the stream it is at, idle long enough in
        others' hands, claimed (ours kept from going idle first); at the end of that stream's
        pending entries its idle consumers are pruned and its orphans claimed, then the next
        stream; after the last, the next scan waits ``claim_idle_ms / 4``. A stream broken
        meanwhile (its writer may) is passed over: the next read makes it again."""
        stream, good, again = self.streams[self._claiming], [], 0
        try:
            held = sorted(eid for s, eid in self._held if s == stream)
            if held:  # keep what we hold from going idle (JUSTID: no delivery counted)
                self.client.xclaim(stream, GROUP, self.consumer, 0, held, justid=True)
            cursor, good, _ = self._fetch("claim", [stream], self._claim_cursor[stream], count)
            self._claim_cursor[stream] = cursor or "0-0"
            if self._claim_cursor[stream] == "0-0":  # scanned the stream's whole pending list
                self._prune(stream)
                again = self._claim_orphans(stream)  # (then scanned again at once)
        except redis.ResponseError as e:
            if not _broken(e):
                raise
            warn_once(f"{stream}: {e}; its claim scan passed over")
            self._claim_cursor[stream] = "0-0"
        if self._claim_cursor[stream] == "0-0" and not again:
            self._claiming = (self._claiming + 1) % len(self.streams)
            if not self._claiming:
                self._next_claim = now + max(self.claim_idle_ms / 4000, 0.05)
        if good:
            log.info("claimed %d pending %s entries", len(good), self.source(stream))
        return good

    def ack(self, entries: Sequence[Entry] = ()) -> None:
        """Acknowledge and delete ``entries`` and those deferred (:meth:`defer_ack`), in one
        step; one round trip for them all, none if there are none."""
        self.defer_ack(entries)
        self._acked_with(None)

    def defer_ack(self, entries: Sequence[Entry]) -> None:
        """Acknowledge and delete ``entries`` in the round trip of this consumer's next read
        (or next :meth:`ack`): they stay pending until then, held by this consumer."""
        self._acking = [*self._acking, *((e.stream or self.streams[0], e.id) for e in entries)]

    def _acked_with(self, call: tuple[Any, list[str], list[Any]] | None) -> Any:
        """The deferred acknowledgements and then ``call`` (a script, its keys and args;
        ``None``: none) in one round trip; ``call``'s reply. A stream replaced by another
        type lost its entries anyway (warned); any other error is raised, and deferred
        acknowledgements not yet known done go with the next round trip (twice is harmless)."""
        held = self._acking
        calls = [(self._ack, [s], ids) for s, ids in _by_stream(held).items()]
        acks = len(calls)
        if call is not None:
            calls.append(call)
        if not calls:
            return None
        if len(calls) > 1:
            replies = run_scripts(self.client, calls, errors=True)
        else:
            script, keys, args = calls[0]
            try:
                replies = [script(keys=keys, args=args)]
            except redis.ResponseError as e:
                replies = [e]
        for reply in replies[:acks]:
            if isinstance(reply, redis.ResponseError) and "WRONGTYPE" in str(reply):
                warn_once(f"{self.name}: {reply}; its entries are lost")
            elif isinstance(reply, Exception):
                raise reply
        self._acking = []
        self._held.difference_update(held)
        if call is None:
            return None
        if isinstance(replies[-1], Exception):
            raise replies[-1]
        return replies[-1]

    def release(self, entries: Sequence[Entry]) -> None:
        """Give up ``entries`` without acknowledging: they stay pending and can be claimed
        again (by any consumer, this one included) once idle."""
        self._held.difference_update((e.stream or self.streams[0], e.id) for e in entries)

    def _prune(self, stream: str) -> None:
        """Remove up to ``PRUNE_MAX`` consumers of ``stream`` that hold nothing and were idle
        for ``claim_idle_ms``, in one script call (the listing is one command)."""
        idle = [
            c["name"]
            for c in self.client.xinfo_consumers(stream, GROUP)
            if not c["pending"] and c["idle"] > self.claim_idle_ms
        ]
        idle = [n for n in idle if text(n) != self.consumer][:PRUNE_MAX]
        if idle:
            self._leave(keys=[stream], args=[GROUP, *idle])

    def _claim_orphans(self, stream: str) -> int:
        """Claim entries of ``stream`` nobody would be handed
        (``qrl/wire/lua/streams.adopt.lua``); how many (the claim scan then goes over the
        stream's pending entries again at once, which hands them out)."""
        cursor = self._orphan_cursor[stream]
        args = [self.consumer, cursor, self.count, self._cap, self.claim_idle_ms]
        cursor, n = self._adopt(keys=[stream], args=args)
        self._orphan_cursor[stream] = text(cursor)
        if n:
            warn_once(f"{stream}: entries no consumer held or would be handed: claimed")
            self._next_claim = 0.0
        return n

    def close(self) -> None:
        """Acknowledge the deferred entries, then leave the group of each stream, unless
        entries are still pending for this consumer there (then they stay claimable by
        others). Best effort: Redis may already be gone."""
        try:
            self.ack()
            _each(self.client, [(self._leave, [s], [GROUP, self.consumer]) for s in self.streams])
        except redis.RedisError as e:
            log.debug("could not leave the %s group: %s", self.name, e)

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
