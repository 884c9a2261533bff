"""The Lua scripts of the prioritized replay (:mod:`qrl.replay.store`): the insert with
its FIFO eviction, and the two samplings. Each is one atomic step, so readers never see half
an insert or an eviction. The frame replay's (:mod:`qrl.replay.frames`) come last. Each
text is fixed (a role's ACL user may run only qrl's scripts, by SHA: :mod:`qrl.wire.scripts`),
so what differs per replay (record size, capacity) comes in ARGV.

A writer with the run's keys can store anything in the replay's keys, so nothing stored
decides how much a script does: :data:`PRELUDE` checks every stored number and repairs what
is out of range, in bounded work.
"""

# the functions every replay script starts with (KEYS: prio, data, meta, batches, ...)
PRELUDE = """
local EXTRA = 4096  -- ids a call may evict beyond its own batch (a lowered capacity)
local MAX_ID = 1e15  -- ids stay exact in a Lua double and print with %d
local fmt = string.format
-- a stored whole number in [0, MAX_ID] (0 if missing), else nil: garbage
local function whole(v)
  if not v then return 0 end
  if #v > 16 or not string.match(v, '^%d+$') then return nil end
  local x = tonumber(v)
  if x > MAX_ID then return nil end
  return x
end
-- delete each KEYS[i] whose type is not types[i] (a writer's key of another type); how many
local function fix_types(types)
  local fixed = 0
  for i, t in ipairs(types) do
    local k = redis.call('TYPE', KEYS[i])['ok']
    if k ~= t and k ~= 'none' then redis.call('UNLINK', KEYS[i]); fixed = fixed + 1 end
  end
  return fixed
end
-- cmd key list... in slices (unpack takes a few thousand values at most)
local function each(cmd, key, list)
  for s = 1, #list, 4000 do redis.call(cmd, key, unpack(list, s, math.min(s + 3999, #list))) end
end
-- the meta's next id (hi) and oldest id present (lo) for an insert into a replay of cap,
-- and 1 if they were garbage and were repaired. Consistent meta has 0 <= lo <= hi and
-- hi - lo <= cap (up to EXTRA more after the capacity was lowered); anything else would
-- make the eviction walk an unbounded range. Ids left below a repaired lo stay (at most
-- a capacity's worth, once per repair) and a repaired hi may overwrite ids: both bounded.
-- A repaired hi starts again from lo, or from 0 if lo is past half of MAX_ID (else ids
-- could run past MAX_ID at every insert, and every insert repair them to the same lo).
local function span(cap)
  local m = redis.call('HMGET', KEYS[3], 'hi', 'lo')
  local hi, lo, bad = whole(m[1]), whole(m[2]), 0
  if not hi then hi, bad = (lo and lo < MAX_ID / 2) and lo or 0, 1 end
  if not lo or lo > hi or hi - lo > cap + EXTRA then lo, bad = math.max(0, hi - cap), 1 end
  return hi, lo, bad
end
-- add by to the meta's counter field, from 0 again if it held garbage
local function bump(field, by)
  if not whole(redis.call('HGET', KEYS[3], field)) then redis.call('HDEL', KEYS[3], field) end
  return redis.call('HINCRBY', KEYS[3], field, by)
end
-- the start of an insert of n into a replay of cap (ARGV[2]: its batch id, '' for none),
-- KEYS of the given types: the first new id (nil: the batch was inserted already), lo and
-- the number of repairs made
local function begin(types, cap, n)
  local repaired = fix_types(types)
  if ARGV[2] ~= '' and redis.call('ZSCORE', KEYS[4], ARGV[2]) then return nil, nil, repaired end
  local first, lo, bad = span(cap)
  if ARGV[2] ~= '' then
    redis.call('ZADD', KEYS[4], first + n, ARGV[2])
    bump('batches', 1)
  end
  return first, lo, repaired + bad
end
-- forget up to limit batch ids whose transitions are all gone (all below lo)
local function forget_batches(lo, limit)
  local below = '(' .. fmt('%d', lo + 1)
  each('ZREM', KEYS[4], redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', below, 'LIMIT', 0, limit))
end
"""

INSERT = """
-- KEYS: prio, data, meta, batches
-- ARGV: capacity, batch_id, n, record size, the n priorities (decimal, space-separated),
--       the n records (each of the record size) concatenated
-- returns {evicted (-1: a batch already inserted), keys or meta repaired}
-- ids are formatted once with %d: a Lua number passed to redis.call costs a %.17g each time
local cap, n, size, blob = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6]
local prio = {}
for p in string.gmatch(ARGV[5], '%S+') do prio[#prio + 1] = p end
if #prio ~= n or #blob ~= n * size then
  return redis.error_reply('replay insert: priorities or records do not match n')
end
local first, lo, repaired = begin({'zset', 'hash', 'hash', 'zset'}, cap, n)
if not first then return {-1, repaired} end
local hi = first + n
local sub = string.sub
local z, h = {}, {}
for i = 1, n do
  local id = fmt('%d', first + i - 1)
  z[2 * i - 1] = prio[i]; z[2 * i] = id
  h[2 * i - 1] = id; h[2 * i] = sub(blob, (i - 1) * size + 1, i * size)
end
each('ZADD', KEYS[1], z)
each('HSET', KEYS[2], h)
bump('inserted', n)
local evicted = 0
if hi - lo > cap then  -- at most n + EXTRA ids: span checked lo
  local ids = {}
  for id = lo, hi - cap - 1 do ids[#ids + 1] = fmt('%d', id) end
  each('ZREM', KEYS[1], ids)
  each('HDEL', KEYS[2], ids)
  evicted, lo = #ids, hi - cap
  forget_batches(lo, n + EXTRA)
  bump('evicted', evicted)
end
redis.call('HSET', KEYS[3], 'hi', fmt('%d', hi), 'lo', fmt('%d', lo))
return {evicted, repaired}
"""

# how the sampling scripts fetch the records of ids[s..e] (a subclass may fetch otherwise)
# and the types its keys must have (a key of another type is deleted); what it needs of the
# layout comes last in ARGV (PrioritizedReplay.record_args)
RECORDS = """
local TYPES = {'zset', 'hash'}
local SIZE = tonumber(ARGV[#ARGV])  -- the record size
-- a record of another size comes back as nil: never sent whole
local function records(ids, s, e)
  local out = redis.call('HMGET', KEYS[2], unpack(ids, s, e))
  for i = 1, #out do
    if out[i] and #out[i] ~= SIZE then out[i] = false end
  end
  return out
end
"""

FETCH_RANKS = """
-- KEYS: prio, data; ARGV: 'desc'|'asc', the ranks (0-based, space-separated), RECORDS' own
-- returns {n_present, {id, score, record}...}
-- each rank goes on to ZRANGE as the string it came as (a Lua number would be formatted
-- with %.17g per call), a repeated rank reuses the last lookup, and one HMGET fetches
-- the records
fix_types(TYPES)
local desc = ARGV[1] == 'desc'
local ids, scores, last, m = {}, {}, nil, nil
for r in string.gmatch(ARGV[2], '%d+') do
  if r ~= last then
    if desc then m = redis.call('ZRANGE', KEYS[1], r, r, 'REV', 'WITHSCORES')
    else m = redis.call('ZRANGE', KEYS[1], r, r, 'WITHSCORES') end
    last = r
  end
  if m[1] then ids[#ids + 1] = m[1]; scores[#scores + 1] = m[2] end
end
local out = {}
for s = 1, #ids, 4000 do
  local recs = records(ids, s, math.min(s + 3999, #ids))
  for j = 1, #recs do
    local i = s + j - 1
    out[3 * i - 2] = ids[i]; out[3 * i - 1] = scores[i]; out[3 * i] = recs[j]
  end
end
return {redis.call('ZCARD', KEYS[1]), out}
"""

SAMPLE_PROPORTIONAL = """
-- KEYS: prio, data; ARGV: alpha, lo, ratio, n_buckets, u (increasing, in [0, 1): float64
-- little-endian, concatenated), RECORDS' own
-- returns {n_present, {id, score, record, prob}...}, total mass (%.17g)
fix_types(TYPES)
local alpha, lo = tonumber(ARGV[1]), tonumber(ARGV[2])
-- at most 1,024 buckets whatever ARGV[4] says (qrl sends N_BUCKETS, 133): any role may run
-- this script, and 10^9 buckets would hold Redis for minutes even on an empty key
local ratio, k = tonumber(ARGV[3]), math.min(tonumber(ARGV[4]) or 0, 1024)
local counts, mass, starts = {}, {}, {}
local total, rank = 0, 0
-- bucket b is [edge(b), edge(b + 1)) with edge(b) = lo * ratio^b; both ends are written
-- from the same number with %.17g (exact), so the buckets tile the line: no priority
-- falls between two buckets or into two (tostring, used by '..', keeps only 14 digits)
local edge = fmt('%.17g', lo)
for b = 0, k - 1 do
  local lower = lo * ratio ^ b
  local next_edge = fmt('%.17g', lo * ratio ^ (b + 1))
  local lower_s = (b == 0) and '-inf' or edge
  local upper_s = (b == k - 1) and '+inf' or ('(' .. next_edge)
  edge = next_edge
  local c = redis.call('ZCOUNT', KEYS[1], lower_s, upper_s)
  local w = (lower * math.sqrt(ratio)) ^ alpha
  counts[b] = c; mass[b] = c * w; starts[b] = rank
  rank = rank + c; total = total + c * w
end
local out = {}
if total <= 0 or #ARGV[5] == 0 then return {rank, out, fmt('%.17g', total)} end
-- the u are increasing (stratified), so one walk over the buckets serves every draw
local ids, scores, probs, last, m = {}, {}, {}, nil, nil
local b, acc = 0, 0
for i = 1, #ARGV[5] / 8 do
  local target = struct.unpack('<d', ARGV[5], 8 * i - 7) * total
  while b < k - 1 and (counts[b] == 0 or acc + mass[b] <= target) do
    acc = acc + mass[b]; b = b + 1
  end
  local bb = b
  while counts[bb] == 0 and bb > 0 do bb = bb - 1 end
  local j = math.floor((target - acc) / mass[bb] * counts[bb])
  if j >= counts[bb] then j = counts[bb] - 1 end
  if j < 0 then j = 0 end
  local pos = fmt('%d', starts[bb] + j)
  if pos ~= last then m = redis.call('ZRANGE', KEYS[1], pos, pos, 'WITHSCORES'); last = pos end
  if m[1] then
    ids[#ids + 1] = m[1]; scores[#scores + 1] = m[2]
    probs[#probs + 1] = fmt('%.17g', mass[bb] / counts[bb] / total)
  end
end
for s = 1, #ids, 4000 do
  local recs = records(ids, s, math.min(s + 3999, #ids))
  for j = 1, #recs do
    local i = s + j - 1
    out[4 * i - 3] = ids[i]; out[4 * i - 2] = scores[i]; out[4 * i - 1] = recs[j]
    out[4 * i] = probs[i]
  end
end
return {rank, out, fmt('%.17g', total)}
"""


# the chunks of ids[s..e], with each id's distance to its chunk's start (ring slot id % CAP);
# a member that is no id, or a ring entry pointing before id 0, fetches no chunk, and a
# chunk longer than any chunk can be (MAX_CHUNK) comes back as nil: never sent whole
FRAME_CHUNKS = """
local TYPES = {'zset', 'hash', 'string', 'hash'}
local CAP, MAX_CHUNK = tonumber(ARGV[#ARGV - 1]), tonumber(ARGV[#ARGV])
local function records(ids, s, e)
  local out = {}
  for i = s, e do
    local id, rel, chunk = whole(ids[i]), '', false
    if id then
      local at = (id % CAP) * 4
      rel = redis.call('GETRANGE', KEYS[3], at, at + 3)
      if #rel == 4 and struct.unpack('<I4', rel) <= id then
        chunk = redis.call('HGET', KEYS[4], fmt('%d', id - struct.unpack('<I4', rel)))
        if chunk and #chunk > MAX_CHUNK then chunk = false end
      end
    end
    out[#out + 1] = {rel, chunk}
  end
  return out
end
"""

FRAME_INSERT = """
-- KEYS: prio, frames, meta, batches, index
-- ARGV: capacity, batch_id, n, the n priorities (space-separated), each chunk's first
--       position (space-separated), each chunk's size, the chunks concatenated, the ring
--       entries (n x u32: distance to the chunk's first transition)
-- returns {evicted (-1: a batch already inserted), keys or meta repaired}
-- (CHUNK_MAX is set before it: no chunk holds more transitions)
local cap, n, blob, ring = tonumber(ARGV[1]), tonumber(ARGV[3]), ARGV[7], ARGV[8]
local sub = string.sub
local prio, pos, size, total = {}, {}, {}, 0
for p in string.gmatch(ARGV[4], '%S+') do prio[#prio + 1] = p end
for p in string.gmatch(ARGV[5], '%d+') do pos[#pos + 1] = tonumber(p) end
for p in string.gmatch(ARGV[6], '%d+') do
  size[#size + 1] = tonumber(p); total = total + size[#size]
end
if #prio ~= n or #ring ~= 4 * n or #pos ~= #size or total ~= #blob then
  return redis.error_reply('frame replay insert: priorities, chunks or ring do not match')
end
local first, lo, repaired = begin({'zset', 'hash', 'hash', 'zset', 'string'}, cap, n)
if not first then return {-1, repaired} end
local hi = first + n
local z, h, off = {}, {}, 1
for i = 1, n do z[2 * i - 1] = prio[i]; z[2 * i] = fmt('%d', first + i - 1) end
for c = 1, #pos do
  h[2 * c - 1] = fmt('%d', first + pos[c]); h[2 * c] = sub(blob, off, off + size[c] - 1)
  off = off + size[c]
end
each('ZADD', KEYS[1], z)
each('HSET', KEYS[2], h)
local skip = math.max(0, n - cap)
local at, data = (first + skip) % cap, sub(ring, 4 * skip + 1)
local head = math.min(#data, (cap - at) * 4)
redis.call('SETRANGE', KEYS[5], at * 4, sub(data, 1, head))
if head < #data then redis.call('SETRANGE', KEYS[5], 0, sub(data, head + 1)) end
bump('inserted', n)
if hi - lo <= cap then
  redis.call('HSET', KEYS[3], 'hi', fmt('%d', hi), 'lo', fmt('%d', lo))
  return {0, repaired}
end
local new_lo = hi - cap  -- at most n + EXTRA past lo: span checked it
local function drop(cmd, key, a, b)  -- ids a .. b - 1
  local ids = {}
  for id = a, b - 1 do ids[#ids + 1] = fmt('%d', id) end
  each(cmd, key, ids)
end
drop('ZREM', KEYS[1], lo, new_lo)
-- the chunks to delete start in [clo, cs): clo the first chunk of the old lo, cs the chunk
-- of new_lo; a ring entry or clo out of range (no chunk is longer than CHUNK_MAX) is garbage
local r = (new_lo % cap) * 4
local rel = redis.call('GETRANGE', KEYS[5], r, r + 3)
rel = #rel == 4 and struct.unpack('<I4', rel) or 0
if rel >= CHUNK_MAX or rel > new_lo then rel, repaired = 0, repaired + 1 end
local cs, clo = new_lo - rel, whole(redis.call('HGET', KEYS[3], 'clo'))
if not clo or clo < lo - CHUNK_MAX or clo > lo then
  clo, repaired = math.max(0, lo - CHUNK_MAX), repaired + 1
end
drop('HDEL', KEYS[2], clo, cs)
redis.call('HSET', KEYS[3], 'hi', fmt('%d', hi), 'lo', fmt('%d', new_lo), 'clo', fmt('%d', cs))
forget_batches(new_lo, n + EXTRA)
bump('evicted', new_lo - lo)
return {new_lo - lo, repaired}
"""
