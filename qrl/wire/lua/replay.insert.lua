-- The insert with its FIFO eviction (after replay.prelude).
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
