"""Metrics: every process appends small reports to a capped stream of its own,
``metrics:ROLE.N`` (:meth:`qrl.wire.keys.RunKeys.metrics`), which only its user may write
where processes have users of their own (``qrl run join``, ``qrl train --acl``); anyone can
follow them all (no consumer group: metrics are broadcast, old ones are trimmed). A report
is the process's whose stream it is in: it names no role or number, so none can pass for
another."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import redis

from qrl.runtime.status import beat
from qrl.wire import clock
from qrl.wire import stream_scripts as lua
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.faults import delete_broken, repaired, skip_if_full, warn_every, warn_once
from qrl.wire.keys import RunKeys
from qrl.wire.schema import Field, Schema
from qrl.wire.stream_scripts import dead_letter, stored_cap, text
from qrl.wire.streams import FIELD

log = logging.getLogger(__name__)

# entries each process's stream keeps: a typical run's ten or so processes (a learner, a
# replay filler, eight actors), each reporting once a second, keep about the 10,000 entries
# (a few MiB) that the one stream all of them shared kept, and each its last ~17 minutes
MAXLEN = 1_000


def _check_metrics(msg: dict[str, Any]) -> None:
    for k, v in msg["values"].items():
        ok = isinstance(v, (int, float)) or (
            isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
        )
        if not ok:
            raise CodecError(f"metric {k!r} is not a number or a list of numbers")


METRICS = Schema(
    "metrics",
    {
        "time": Field(float),
        "values": Field(dict, max_len=16_384),  # lists of up to this many numbers, too
    },
    check=_check_metrics,
    max_bytes=1 << 20,
)


def report(client: redis.Redis, keys: RunKeys, role: str, ident: int = 0, **values: Any) -> None:
    """Append one report ``values`` (numbers or lists of numbers) to the stream of ``role``
    #``ident``, and refresh the process's heartbeat (see :mod:`qrl.runtime.status`) in the
    same round trip. Reports can be lost: while Redis is out of memory they are skipped, not
    waited for."""
    now = time.time()
    payload = encode("metrics", {"time": now, "values": values})
    stream = keys.metrics(role, ident)

    def write() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.xadd(stream, {FIELD: payload}, maxlen=MAXLEN, approximate=True)
        beat(pipe, keys, role, ident, now, values)
        pipe.execute()

    with skip_if_full("metrics report"):
        repaired(client, stream, write, None)


def _id(entry_id: str) -> tuple[int, ...]:
    return tuple(map(int, entry_id.split("-")))


class MetricsReader:
    """Follows the reports of the processes ``sources``, (role, number) pairs (a run's:
    :meth:`qrl.runtime.algorithm.Algorithm.reporters`), from now (or from the start with
    ``from_start``), each from its own stream, all of them in one call of the script
    ``metrics.range`` (``qrl/wire/lua/metrics.range.lua``) a read. A report is the process's
    whose stream it came from.

    Anyone with a process's keys can add anything to its stream: entries are read a bounded
    number at a time and measured inside Redis first, so one larger than a report can be is
    skipped and dead-lettered by its size, never fetched; a stream deleted and started
    afresh (its process repairs one whose ids were used up) is followed from its new start;
    one of another Redis type is deleted where this user may (else left unread)."""

    COUNT = 1000  # entries one read examines at most
    CAP = stored_cap(METRICS.max_bytes)  # the largest entry a report can be
    BUDGET = 4 * CAP  # bytes one read examines at most (honest reports are ~1,000 times smaller)

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        sources: Iterable[tuple[str, int]],
        from_start: bool = False,
    ) -> None:
        self.client, self.keys = client, keys
        self.sources = list(dict.fromkeys(sources))
        self.streams = [keys.metrics(role, ident) for role, ident in self.sources]
        self._range = lua.RANGE_LUA.on(client)
        self._next_check = 0.0  # when to look again for streams started afresh
        self._turn = 0  # the stream the range script takes first
        self.last = ["0-0"] * len(self.streams)  # the id each stream was read up to
        if not from_start:  # each stream's newest entry: nothing comes after LAST_ID
            newest, _ = self._call([lua.LAST_ID] * len(self.streams), check=True)
            for i, entry_id in newest.items():
                self.last[i] = entry_id

    def _call(self, cursors: list[str], check: bool = False) -> tuple[dict[int, str], list]:
        """One call of the range script from ``cursors``: the newest id of each stream it
        checked (see ``qrl/wire/lua/metrics.range.lua``) and the rows, ``(stream, id, fields
        or size)``, streams by their index here. The script takes the streams in
        order, from one that moves on by the rows each call returned: a call that reached
        its count left some streams unread, and entries flooding the first ones must not
        keep the others out."""
        n, k = len(self.streams), self._turn
        if not n:
            return {}, []
        args = [self.COUNT, self.CAP, self.BUDGET, int(check), *cursors[k:], *cursors[:k]]
        wrong, newest, rows = self._range(self.streams[k:] + self.streams[:k], args)

        def at(i: int) -> int:  # the script's (from 1) as ours
            return (i - 1 + k) % n

        for i in wrong:
            delete_broken(self.client, self.streams[at(i)])
        self._turn = (k + len(rows)) % n
        newest = {at(i): text(x) for i, x in zip(newest[::2], newest[1::2], strict=True)}
        return newest, [(at(i), text(entry_id), body) for i, entry_id, body in rows]

    def read(self, block_ms: int | None = None) -> list[dict[str, Any]]:
        """The reports added since the last read, as ``{role, id, time, values}``; with
        ``block_ms``, waits up to that long for one (scripts cannot block: it polls,
        backing off up to 50 ms, or ten times what a poll took where that is longer: a run
        configured for thousands of processes has thousands of streams, and its follower
        keeps Redis busy a small share of the time)."""
        deadline = clock.now() + (block_ms or 0) / 1000
        delay = 0.005
        while True:
            began = time.monotonic()
            out, came = self._read_once()
            now = clock.now()
            left = deadline - now
            if out or (left <= 0 and not came):  # junk only: on to what comes after it
                return out
            if not came:
                clock.sleep(min(delay, left))
                delay = min(delay * 2, max(0.05, 10 * (now - began)))

    def _read_once(self) -> tuple[list[dict[str, Any]], bool]:
        """The reports of one call of the range script, oldest first, and whether any entry
        came (or a stream started afresh is to be read from its start)."""
        check = time.monotonic() >= self._next_check
        if check:
            self._next_check = time.monotonic() + 1.0
        newest, rows = self._call(self.last, check)
        afresh = [i for i, n in newest.items() if _id(n) < _id(self.last[i])]
        for i in afresh:
            warn_every(
                f"{self.streams[i]}:followed",  # not repaired()'s: its reporter may log that
                "%s was deleted and started afresh (its ids were used up?): following it "
                "from its new start",
                self.streams[i],
                logger=log,
            )
            self.last[i] = "0-0"
        out = []
        for i, entry_id, body in sorted(rows, key=lambda row: _id(row[1])):
            self.last[i] = entry_id
            msg = self._decode(self.sources[i], entry_id, body)
            if msg is not None:
                out.append(msg)
        return out, bool(rows or afresh)

    def _decode(self, source: tuple[str, int], entry_id: str, body: Any) -> dict | None:
        """The report in entry ``entry_id`` of ``source``'s stream (``body``: its fields, or
        its size where it was too big to fetch); ``None``, dead-lettered, if it is none."""
        payload, size = None, None
        try:
            if isinstance(body, int):  # measured in Redis and left there
                size = body
                raise CodecError(f"entry over the {self.CAP} bytes a report may take")
            fields = dict(zip(body[::2], body[1::2], strict=True))
            payload = fields.get(FIELD)
            if payload is None:
                raise CodecError("metrics entry without payload")
            return {"role": source[0], "id": source[1], **decode(payload, METRICS)}
        except CodecError as e:
            reason = f"metrics: {e}"  # logged once per reason: the dead letters keep each
            warn_once(
                reason,
                "rejected metrics entry %s of %s.%d: %s",
                entry_id,
                *source,
                e,
                kind="rejected entries",
                logger=log,
            )
            where = f"{source[0]}.{source[1]} {entry_id}"
            dead_letter(self.client, self.keys, "metrics", str(e), payload, where, size)
        return None
