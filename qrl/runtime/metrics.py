"""Metrics: every role appends small reports to the run's capped metrics stream; anyone can
follow it (no consumer group: metrics are broadcast, old ones are trimmed)."""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import redis

from qrl.runtime.status import beat
from qrl.wire import clock
from qrl.wire import stream_scripts as lua
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.faults import repaired, skip_if_full, warn_every, warn_once
from qrl.wire.keys import RunKeys
from qrl.wire.schema import Field, Schema
from qrl.wire.stream_scripts import dead_letter, stored_cap, text
from qrl.wire.streams import FIELD

log = logging.getLogger(__name__)

MAXLEN = 10_000


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
        "role": Field(str),
        "id": Field(int),
        "time": Field(float),
        "values": Field(dict, max_len=16_384),  # lists of up to this many numbers, too
    },
    check=_check_metrics,
    max_bytes=1 << 20,
)


def report(client: redis.Redis, keys: RunKeys, role: str, ident: int = 0, **values: Any) -> None:
    """Append one report ``values`` (numbers or lists of numbers) from ``role`` #``ident``,
    and refresh the process's heartbeat (see :mod:`qrl.runtime.status`) in the same round trip.
    Reports can be lost: while Redis is out of memory they are skipped, not waited for."""
    now = time.time()
    payload = encode("metrics", {"role": role, "id": ident, "time": now, "values": values})

    def write() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.xadd(keys.metrics, {FIELD: payload}, maxlen=MAXLEN, approximate=True)
        beat(pipe, keys, role, ident, now, values)
        pipe.execute()

    with skip_if_full("metrics report"):
        repaired(client, keys.metrics, write, None)


def _id(entry_id: str) -> tuple[int, ...]:
    return tuple(map(int, entry_id.split("-")))


class MetricsReader:
    """Follows the metrics stream from now (or from the start with ``from_start``).

    Anyone with the run's keys can add anything to it: entries are read a bounded number at
    a time and measured inside Redis first (:data:`qrl.wire.stream_scripts.RANGE`), so one
    larger than a report can be is skipped and dead-lettered by its size, never fetched; and
    a stream deleted and started afresh (a role repairs one whose ids were used up) is
    followed from its new start."""

    COUNT = 1000  # entries one read examines at most
    CAP = stored_cap(METRICS.max_bytes)  # the largest entry a report can be
    BUDGET = 4 * CAP  # bytes one read examines at most (honest reports are ~1,000 times smaller)

    def __init__(self, client: redis.Redis, keys: RunKeys, from_start: bool = False) -> None:
        self.client, self.keys = client, keys
        self._range = lua.RANGE_LUA.on(client)
        self._next_check = 0.0  # when to look again for a stream started afresh
        self.last = "0-0" if from_start else self._call(lua.LAST_ID, check=True)[0] or "0-0"

    def _call(self, after: str, check: bool = False) -> tuple[str | None, list]:
        """One call of the range script: the rows after ``after`` and, with ``check`` where
        none came and ``after`` is ahead of Redis's clock, the stream's newest id."""
        args = [after, self.COUNT, self.CAP, self.BUDGET, int(check)]
        call = partial(self._range, [self.keys.metrics], args)
        newest, rows = repaired(self.client, self.keys.metrics, call, [None, []])
        return (None if newest is None else text(newest)), rows

    def read(self, block_ms: int | None = None) -> list[dict[str, Any]]:
        """The reports added since the last read; with ``block_ms``, waits up to that long
        for one (scripts cannot block: it polls, backing off up to 50 ms)."""
        deadline = clock.now() + (block_ms or 0) / 1000
        delay = 0.005
        while True:
            out, came = self._read_once()
            left = deadline - clock.now()
            if out or (left <= 0 and not came):  # junk only: on to what comes after it
                return out
            if not came:
                clock.sleep(min(delay, left))
                delay = min(delay * 2, 0.05)

    def _read_once(self) -> tuple[list[dict[str, Any]], bool]:
        """The reports of one call of the range script, and whether any entry came."""
        check = time.monotonic() >= self._next_check
        if check:
            self._next_check = time.monotonic() + 1.0
        newest, rows = self._call(self.last, check)
        if newest is not None and _id(newest) < _id(self.last):
            warn_every(
                f"{self.keys.metrics}:followed",  # not repaired()'s: a reporter may log that
                "%s was deleted and started afresh (its ids were used up?): following it "
                "from its new start",
                self.keys.metrics,
                logger=log,
            )
            self.last = "0-0"
            newest, rows = self._call(self.last)
        out = []
        for row in rows:
            entry_id, body = text(row[0]), row[1]
            self.last = entry_id
            payload, size = None, None
            try:
                if isinstance(body, int):  # measured in Redis and left there
                    size = body
                    raise CodecError(f"entry over the {self.CAP} bytes a report may take")
                fields = dict(zip(body[::2], body[1::2], strict=True))
                payload = fields.get(FIELD)
                if payload is None:
                    raise CodecError("metrics entry without payload")
                out.append(decode(payload, METRICS))
            except CodecError as e:
                reason = f"metrics: {e}"  # logged once per reason: the dead letters keep each
                warn_once(
                    reason,
                    "rejected metrics entry %s: %s",
                    entry_id,
                    e,
                    kind="rejected entries",
                    logger=log,
                )
                dead_letter(self.client, self.keys, "metrics", str(e), payload, entry_id, size)
        return out, bool(rows)
