-- The frame replay's insert with its FIFO eviction (after replay.prelude).
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
