"""What the Lua scripts of :mod:`qrl.wire.streams` (``qrl/wire/lua/streams.*.lua``; each runs
atomically inside Redis and touches keys of one run's hash tag only, so it is legal in a Redis
Cluster) share with Python: their bounds, the dead letters and the metrics' range script, and
the helpers that read their arguments and replies. Every loop in them is bounded by the
caller's own arguments (a batch count, a list of names), never by stored state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from qrl.wire import faults
from qrl.wire.faults import out_of_memory, skip_if_full
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import Lua

log = logging.getLogger("qrl.wire.streams")  # what the scripts repair is the streams' business

T = TypeVar("T")

DEADLETTER_MAXLEN = 10_000
DEADLETTER_MAX_PAYLOAD = 4096  # bytes of a rejected payload kept (its full size is recorded):
# 10,000 entries x 4 KiB bounds the dead-letter stream to ~40 MiB


def warn_once(*messages: str | bytes) -> None:
    """Log each message (a script's reply may hold several, as bytes) the first time it
    happens in this process: someone who keeps breaking a key must not flood the log."""
    for m in map(text, messages):
        faults.warn_once(m, "%s", m, logger=log)


def optional(what: str, write: Callable[[], T]) -> T | None:
    """``write()``, a write that can be lost (a dead letter, a counter, an entry a producer
    retries): ``None``, with one warning, while Redis is out of memory, not waited for."""
    try:
        with skip_if_full(what):
            return write()
    except redis.ResponseError as e:  # a plain client's (not connect()'s) refusal
        if not out_of_memory(e):
            raise
        warn_once(f"Redis is out of memory: {what} skipped until it has room")
    return None


def stored_cap(max_bytes: int) -> int:
    """The largest stored entry (field names and values) whose payload can inflate to at
    most ``max_bytes``: LZ4's worst case is +0.4% plus frame and block headers."""
    return max_bytes + max_bytes // 128 + 1024


def text(i: Any) -> str:
    return i.decode() if isinstance(i, bytes) else i


# what a script that adds to a stream or counts in a hash starts with: the repair of a key of
# another type (qrl/wire/lua/streams.fix.lua), of a stream whose ids were used up
# (streams.xadd_fresh.lua) and of a counter at the int64 edge (streams.count.lua)
REPAIRS = ("streams.fix", "streams.xadd_fresh", "streams.count")

# a rejected payload in the run's dead-letter stream, counted in its stats (dead_letter)
DEAD_LETTER_LUA = Lua("streams.dead_letter", *REPAIRS, "streams.dead_letter")


def dead_letter_call(
    keys: RunKeys,
    source: str,
    reason: str,
    payload: bytes | None,
    entry_id: str = "",
    size: int | None = None,
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of :data:`DEAD_LETTER_LUA` for one rejected payload."""
    payload = payload or b""
    fields = {
        "source": source,
        "id": entry_id,
        "reason": reason[:1000],
        "time": f"{time.time():.3f}",
        "size": str(len(payload) if size is None else size),
        "payload": payload[:DEADLETTER_MAX_PAYLOAD],
    }
    args = [DEADLETTER_MAXLEN, source, *(x for kv in fields.items() for x in kv)]
    return [keys.deadletter, keys.stats], args


def dead_letter(
    client: redis.Redis | redis.client.Pipeline,
    keys: RunKeys,
    source: str,
    reason: str,
    payload: bytes | None,
    entry_id: str = "",
    size: int | None = None,
) -> bool:
    """Record a rejected payload with its reason in the run's dead-letter stream (capped)
    and count it in the run's stats hash under ``rejected`` and ``rejected:SOURCE``;
    ``size`` (default: the payload's) is recorded too. ``client`` may be a pipeline. Best
    effort: returns False, with one warning, when Redis refused the write (out of memory)."""
    dl_keys, args = dead_letter_call(keys, source, reason, payload, entry_id, size)
    notes = optional(
        f"dead letters of {keys.prefix}{source}", lambda: DEAD_LETTER_LUA(client, dl_keys, args)
    )
    if isinstance(notes, list):  # not on a pipeline (queued: its caller executes it)
        warn_once(*notes)
    return notes is not None


# entries a read or adoption examines at most, whatever its ARGV asks (streams.read.lua,
# streams.adopt.lua: any role may run these scripts)
MAX_ENTRIES = 4096

LAST_ID = "18446744073709551615-18446744073709551615"  # the largest stream id there is

# a follower's read of the metrics streams, one per process (qrl.runtime.metrics.MetricsReader),
# all in one call; asked for what comes after LAST_ID, a stream is not read (where it ends
# now comes back when the caller checks for streams started afresh)
RANGE_LUA = Lua("metrics.range", read_only=True, constants={"LAST_ID": LAST_ID})
