"""Metrics: every role appends small reports to the run's capped metrics stream; anyone can
follow it (no consumer group: metrics are broadcast, old ones are trimmed)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from qrl.runtime.status import beat
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.faults import repaired, skip_if_full
from qrl.wire.keys import RunKeys
from qrl.wire.schema import Field, Schema
from qrl.wire.stream_scripts import dead_letter
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


class MetricsReader:
    """Follows the metrics stream from now (or from the start with ``from_start``)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, from_start: bool = False) -> None:
        self.client, self.keys = client, keys
        newest = (
            None if from_start else self._repaired(lambda: client.xrevrange(keys.metrics, count=1))
        )
        self.last = newest[0][0] if newest else "0-0"

    def read(self, block_ms: int | None = None) -> list[dict[str, Any]]:
        resp = self._repaired(
            lambda: self.client.xread({self.keys.metrics: self.last}, count=1000, block=block_ms)
        )
        out = []
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                self.last = entry_id
                payload = fields.get(FIELD)
                try:
                    if payload is None:
                        raise CodecError("metrics entry without payload")
                    out.append(decode(payload, METRICS))
                except CodecError as e:
                    log.warning("rejected metrics entry: %s", e)
                    dead_letter(self.client, self.keys, "metrics", str(e), payload, entry_id)
        return out

    def _repaired(self, command: Callable[[], list]) -> list:
        return repaired(self.client, self.keys.metrics, command, [])
