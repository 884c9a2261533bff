-- A follower's read of the metrics streams (one per process, no group on them: see
-- qrl.runtime.metrics), all in one call. KEYS: the streams; ARGV: at most how many entries
-- (1,000 whatever it says), the largest entry returned whole, the bytes examined before it
-- stops, '1' to look for streams started afresh, then each stream's cursor (the id it was
-- read up to). XREAD (COUNT 1) takes the next entry of every stream at once, in chunks of
-- 1,000 streams (Lua's unpack holds no more), then again of those that had one, until none
-- has or enough came: each entry is measured here, and one over the largest returned
-- comes back as its size only, never whole. A key of another type is left out and named.
-- Nothing comes after LAST_ID: a stream at it is not read. Returns {the wrong-type keys'
-- indexes, newest, {{key index, id, fields or size}...}}: newest lists (index, id) pairs
-- where '1' asked, nothing came from that stream and its cursor is ahead of Redis's clock
-- (an id someone chose: honest ones never are): the stream's last entry id, which the
-- caller compares with the cursor (ids pass 2^53, which Lua's numbers do not hold) to see
-- a stream deleted and started afresh under it. Only then is the last entry loaded (it may
-- be big): the caller asks at most once a second.
local count, cap, budget = math.min(tonumber(ARGV[1]) or 0, 1000), tonumber(ARGV[2]),
  tonumber(ARGV[3])
local cursor, index, live, wrong, came = {}, {}, {}, {}, {}
for i, key in ipairs(KEYS) do
  cursor[i], index[key] = ARGV[4 + i], i
  if cursor[i] ~= LAST_ID then live[#live + 1] = i end
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
