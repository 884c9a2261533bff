-- Up to ARGV[4] entries for consumer ARGV[1], one at a time, each measured here: one over
-- ARGV[5] bytes (fields and values) is acknowledged and deleted unread and only its size
-- returned. Stops once ARGV[7] bytes were examined. ARGV[2] is the mode: '>' new
-- entries, 'own' this consumer's pending entries after id ARGV[3], 'claim' entries idle
-- for ARGV[6] ms (XAUTOCLAIM from cursor ARGV[3]). Returns {next cursor or false,
-- {id, fields or false (deleted) or size (oversized), times delivered (not for '>')}...}.
-- (MAX_ENTRIES is set before it: the entries a read examines at most, whatever ARGV[4]
-- asks. Any role may run this script, and one asking for 10^9 entries of a long stream
-- would hold Redis for minutes; a consumer asks for far fewer, its batch or SCAN_MAX, and
-- one that wants more reads again.)
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
