"""The Lua scripts of :mod:`qrl.wire.streams` (each runs atomically inside Redis and touches keys
of one run's hash tag only, so it is legal in a Redis Cluster), and the helpers that read
their arguments and replies. Every loop in them is bounded by the caller's own arguments (a
batch count, a list of names), never by stored state.
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


# a key of another type where a stream or hash of ours belongs was written by someone else:
# delete it and say so, for the caller's one warning. UNLINK frees a big one in the
# background; an actor's ACL user may only DEL.
FIX = """
local fixed = {}
local function fix(key, want)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= want then
    if type(redis.pcall('UNLINK', key)) == 'table' then redis.call('DEL', key) end
    fixed[#fixed + 1] = key .. ' was a ' .. t .. ', not a ' .. want .. ' (wrong type): deleted'
  end
end
"""

# XADD key ...: a stream someone gave the last possible id (XADD KEY 18446744073709551615-
# 18446744073709551615 ...) has no id left for '*', ever: it is deleted, with its entries and
# its consumer group's pending ones (they are lost), and added to afresh (noted in FIX's
# ``fixed``). Returns XADD's reply (an error as a table) and whether the stream is new.
XADD_FRESH = """
local function xadd(key, ...)
  local id = redis.pcall('XADD', key, ...)
  if type(id) == 'table' and id.err and string.find(id.err, 'exhausted') then
    redis.call('DEL', key)
    fixed[#fixed + 1] = key .. ' had used up its ids: deleted and recreated'
    return redis.pcall('XADD', key, ...), true
  end
  return id, false
end
"""

# count(key, f): add 1 to counter f of hash key. One HINCRBY refuses (someone left a
# non-number, or a count at the int64 edge) starts again from 1, with what an actor's user
# may run where it can (HINCRBY of the count's negation: it has no HSET), else with HSET.
COUNT = """
local function count(key, f)
  if type(redis.pcall('HINCRBY', key, f, 1)) ~= 'table' then return end
  local v = redis.call('HGET', key, f)
  local undone = v and string.match(v, '^%d+$') and redis.pcall('HINCRBY', key, f, '-' .. v)
  if type(undone) ~= 'number' then redis.pcall('HSET', key, f, 0) end
  redis.pcall('HINCRBY', key, f, 1)
end
"""

ADD_IF_ROOM = (
    FIX
    + XADD_FRESH
    + COUNT
    + """
fix(KEYS[1], 'stream')
if KEYS[2] then fix(KEYS[2], 'hash') end
-- entries waiting = in the stream and not yet delivered to a consumer (XLEN - pending):
-- what consumers hold while assembling a batch must not count, or they could wait forever
local waiting = redis.call('XLEN', KEYS[1])
local pending = redis.pcall('XPENDING', KEYS[1], 'qrl')
if type(pending) == 'table' and pending.err == nil then waiting = waiting - pending[1] end
if waiting >= tonumber(ARGV[1]) then return {false, unpack(fixed)} end
local id, fresh = xadd(KEYS[1], '*', 'd', ARGV[2])
-- a stream started afresh gets its group back (or its consumers recreate it: an actor's
-- user may not)
if fresh then redis.pcall('XGROUP', 'CREATE', KEYS[1], 'qrl', '0', 'MKSTREAM') end
if type(id) == 'table' then return id end  -- an error (out of memory): nothing was added
-- count every entry ever added, in the same step (the run's stats hash, if given)
if KEYS[2] then count(KEYS[2], ARGV[3]) end
return {id, unpack(fixed)}
"""
)

DEAD_LETTER = (
    FIX
    + XADD_FRESH
    + COUNT
    + """
-- KEYS: dead letters, stats; ARGV: maxlen, source, then the entry's field/value pairs
fix(KEYS[1], 'stream')
fix(KEYS[2], 'hash')
local id = xadd(KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 3))
if type(id) == 'table' then return id end  -- an error (out of memory): raised to the caller
count(KEYS[2], 'rejected')
count(KEYS[2], 'rejected:' .. ARGV[2])
return fixed
"""
)
DEAD_LETTER_LUA = Lua("streams.dead_letter", DEAD_LETTER)


def dead_letter_call(
    keys: RunKeys, source: str, reason: str, payload: bytes | None, entry_id: str = "",
    size: int | None = None,
) -> tuple[list[str], list[Any]]:  # fmt: skip
    """The keys and arguments of :data:`DEAD_LETTER` for one rejected payload."""
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


ENSURE_GROUP = (
    FIX
    + """
fix(KEYS[1], 'stream')
local ok = redis.pcall('XGROUP', 'CREATE', KEYS[1], 'qrl', '0', 'MKSTREAM')
if type(ok) == 'table' and ok.err and not string.find(ok.err, 'BUSYGROUP') then return ok end
return fixed
"""
)

# entries a read or adoption examines at most, whatever its ARGV asks: any role may run these
# scripts, and one asking for 10^9 entries of a long stream would hold Redis for minutes (a
# consumer asks for far fewer, its batch or SCAN_MAX, and one that wants more reads again)
MAX_ENTRIES = 4096
_MAX_ENTRIES = f"local MAX_ENTRIES = {MAX_ENTRIES}\n"

READ = (
    _MAX_ENTRIES
    + """
-- Up to ARGV[4] entries for consumer ARGV[1], one at a time, each measured here: one over
-- ARGV[5] bytes (fields and values) is acknowledged and deleted unread and only its size
-- returned. Stops once ARGV[7] bytes were examined. ARGV[2] is the mode: '>' new
-- entries, 'own' this consumer's pending entries after id ARGV[3], 'claim' entries idle
-- for ARGV[6] ms (XAUTOCLAIM from cursor ARGV[3]). Returns {next cursor or false,
-- {id, fields or false (deleted) or size (oversized), times delivered (not for '>')}...}.
local stream, me, mode, cursor = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local count, cap = math.min(tonumber(ARGV[4]) or 0, MAX_ENTRIES), tonumber(ARGV[5])
local ids
if mode == 'claim' then
  local r = redis.call('XAUTOCLAIM', stream, 'qrl', me, ARGV[6], cursor, 'COUNT', count, 'JUSTID')
  cursor, ids = r[1], r[2]
end
local out, seen = {}, 0
for i = 1, count do
  local e
  if ids then  -- claimed: XCLAIM (not JUSTID) fetches it and counts the delivery
    if not ids[i] then break end
    e = redis.call('XCLAIM', stream, 'qrl', me, 0, ids[i])[1] or {ids[i], false}
  else
    local r = redis.call('XREADGROUP', 'GROUP', 'qrl', me, 'COUNT', 1, 'STREAMS', stream,
      mode == '>' and '>' or cursor)
    e = r and r[1][2][1]
    if not e then cursor = false break end
    cursor = e[1]
  end
  local size = 0
  if e[2] then for _, v in ipairs(e[2]) do size = size + #v end end
  seen = seen + size
  if size > cap then
    redis.call('XACK', stream, 'qrl', e[1])
    redis.call('XDEL', stream, e[1])
    e = {e[1], size}
  end
  if mode ~= '>' then  -- how often it was delivered: the caller refuses poison
    local p = redis.call('XPENDING', stream, 'qrl', e[1], e[1], 1)[1]
    e[3] = p and p[4] or 0
  end
  out[#out + 1] = e
  if seen >= tonumber(ARGV[7]) then break end
end
return {cursor, out}
"""
)

LEAVE = """
-- remove consumers ARGV[2..] from group ARGV[1] unless they still hold entries (they would
-- be lost); returns how many left
local n = 0
for i = 2, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i]) == 0 then
    n = n + redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i]) + 1
  end
end
return n
"""

# acknowledge and delete entries ARGV[1..] in one step (a script, not MULTI: Redis out of
# memory refuses every command queued in a MULTI, while XACK and XDEL free memory)
ACK = """
redis.call('XACK', KEYS[1], 'qrl', unpack(ARGV))
return redis.call('XDEL', KEYS[1], unpack(ARGV))
"""

# Entries no consumer will ever be handed: in the stream, at or below the group's
# last-delivered id, yet pending for nobody (someone moved the group's id with XGROUP SETID,
# or acknowledged what a dead consumer held). They would hold the producers' room for good:
# claim them for consumer ARGV[1] as idle for ARGV[5] ms, so its next claim scan hands them
# out. Looks at up to ARGV[3] entries after ARGV[2] ('-': from the start), one at a time,
# stopping after ARGV[3] x ARGV[4] bytes; returns {next cursor ('-' when done), claimed}.
ADOPT = (
    _MAX_ENTRIES
    + """
local stream, me, cursor = KEYS[1], ARGV[1], ARGV[2]
local count, cap = math.min(tonumber(ARGV[3]) or 0, MAX_ENTRIES), tonumber(ARGV[4])
if redis.call('XLEN', stream) <= redis.call('XPENDING', stream, 'qrl')[1] then
  return {'-', 0}  -- everything in the stream is pending or not yet delivered: no orphans
end
local last
for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  for i = 1, #g - 1, 2 do
    if g[i] == 'name' and g[i + 1] ~= 'qrl' then break end
    if g[i] == 'last-delivered-id' then last = g[i + 1] end
  end
end
local adopted, seen = 0, 0
for _ = 1, count do
  local from = cursor == '-' and '-' or '(' .. cursor
  local e = redis.call('XRANGE', stream, from, last, 'COUNT', 1)[1]
  if not e then return {'-', adopted} end
  cursor = e[1]
  if #redis.call('XPENDING', stream, 'qrl', cursor, cursor, 1) == 0 then
    redis.call('XCLAIM', stream, 'qrl', me, 0, cursor, 'IDLE', ARGV[5], 'FORCE', 'JUSTID')
    adopted = adopted + 1
  end
  for _, v in ipairs(e[2]) do seen = seen + #v end
  if seen >= count * cap then break end
end
return {cursor, adopted}
"""
)

LAST_ID = "18446744073709551615-18446744073709551615"  # the largest stream id there is

# A follower's read of the metrics streams (one per process, no group on them: see
# qrl.runtime.metrics), all in one call. KEYS: the streams; ARGV: at most how many entries
# (1,000 whatever it says), the largest entry returned whole, the bytes examined before it
# stops, '1' to look for streams started afresh, then each stream's cursor (the id it was
# read up to). XREAD (COUNT 1) takes the next entry of every stream at once, in chunks of
# 1,000 streams (Lua's unpack holds no more), then again of those that had one, until none
# has or enough came: each entry is measured here, and one over the largest returned
# comes back as its size only, never whole. A key of another type is left out and named.
# Nothing comes after LAST_ID: a stream at it is not read. Returns {the wrong-type keys'
# indexes, newest, {{key index, id, fields or size}...}}: newest lists (index, id) pairs
# where '1' asked, nothing came from that stream and its cursor is ahead of Redis's clock
# (an id someone chose: honest ones never are): the stream's last entry id, which the
# caller compares with the cursor (ids pass 2^53, which Lua's numbers do not hold) to see
# a stream deleted and started afresh under it. Only then is the last entry loaded (it may
# be big): the caller asks at most once a second.
RANGE = """
local count, cap, budget = math.min(tonumber(ARGV[1]) or 0, 1000), tonumber(ARGV[2]),
  tonumber(ARGV[3])
local cursor, index, live, wrong, came = {}, {}, {}, {}, {}
for i, key in ipairs(KEYS) do
  cursor[i], index[key] = ARGV[4 + i], i
  if cursor[i] ~= 'LAST_ID' then live[#live + 1] = i end
end
local function xread(call, ids)
  local args = {'XREAD', 'COUNT', 1, 'STREAMS'}
  for _, i in ipairs(ids) do args[#args + 1] = KEYS[i] end
  for _, i in ipairs(ids) do args[#args + 1] = cursor[i] end
  return call(unpack(args))
end
-- the next entry of each stream of ids, as {index, id, fields}
local function next_entries(ids)
  local got = {}
  for from = 1, #ids, 1000 do
    local part = {unpack(ids, from, math.min(from + 999, #ids))}
    local r = xread(redis.pcall, part)
    if type(r) == 'table' and r.err then  -- a key of another type: leave it out
      local streams = {}
      for _, i in ipairs(part) do
        local t = redis.call('TYPE', KEYS[i]).ok
        if t == 'stream' or t == 'none' then streams[#streams + 1] = i else
          wrong[#wrong + 1] = i end
      end
      r = #streams > 0 and xread(redis.call, streams)  -- another error is the caller's
    end
    for _, s in ipairs(r or {}) do
      got[#got + 1] = {index[s[1]], s[2][1][1], s[2][1][2]}
    end
  end
  return got
end
local out, seen, ids = {}, 0, live
while #ids > 0 do
  local more = {}
  for _, e in ipairs(next_entries(ids)) do
    if #out >= count or seen >= budget then more = {} break end
    local size = 0
    for _, v in ipairs(e[3]) do size = size + #v end
    seen = seen + size
    if size > cap then e[3] = size end
    cursor[e[1]], came[e[1]] = e[2], true
    out[#out + 1] = e
    more[#more + 1] = e[1]
  end
  ids = more
end
local newest = {}
if ARGV[4] == '1' then
  local now = redis.call('TIME')
  for i, key in ipairs(KEYS) do
    if not came[i] and tonumber(string.match(cursor[i], '^%d+')) > now[1] * 1000 + 1000 then
      local last = redis.pcall('XREVRANGE', key, '+', '-', 'COUNT', 1)
      if type(last) == 'table' and last[1] then
        newest[#newest + 1] = i
        newest[#newest + 1] = last[1][1]
      end
    end
  end
end
return {wrong, newest, out}
""".replace("LAST_ID", LAST_ID)
RANGE_LUA = Lua("metrics.range", RANGE, read_only=True)
