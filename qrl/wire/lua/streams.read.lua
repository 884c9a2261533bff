-- (After streams.fix.) Up to ARGV[4] entries for consumer ARGV[1], each measured here: one
-- over ARGV[5] bytes (fields and values) is acknowledged and deleted unread and only its size
-- returned. Stops once ARGV[7] bytes were examined. ARGV[2] is the mode: '>' new entries of
-- the streams KEYS, in turns (one of each stream that has one, in KEYS' order, then again:
-- a busy stream never holds another's back; one XREADGROUP a turn); 'own' this consumer's
-- pending entries of KEYS[1] after id ARGV[3]; 'claim' KEYS[1]'s entries idle for ARGV[6]
-- ms (XAUTOCLAIM from cursor ARGV[3]). Returns {next cursor or false, {id, fields or false
-- (deleted) or size (oversized), times delivered, its stream's index in KEYS}..., notes...}.
-- (MAX_ENTRIES is set before it: the entries a read examines at most, whatever ARGV[4]
-- asks. Any role may run this script, and one asking for 10^9 entries of a long stream
-- would hold Redis for minutes; a consumer asks for far fewer, its batch or SCAN_MAX, and
-- one that wants more reads again.)
local me, mode, cursor = ARGV[1], ARGV[2], ARGV[3]
local count, cap = math.min(tonumber(ARGV[4]) or 0, MAX_ENTRIES), tonumber(ARGV[5])
local budget = tonumber(ARGV[7])
-- a command on KEYS that fails (a stream deleted, of another type or without its group: a
-- writer of one of them may do that) runs again once every stream of KEYS is a stream with
-- the group, so one stream's writer cannot keep the others' entries from being read
local function call(...)
  local r = redis.pcall(...)
  if type(r) ~= 'table' or not r.err then return r end
  for _, key in ipairs(KEYS) do
    fix(key, 'stream')
    if redis.pcall('XGROUP', 'CREATE', key, 'qrl', '0', 'MKSTREAM').ok then
      fixed[#fixed + 1] = key .. ' had no group qrl: made again'
    end
  end
  return redis.call(...)
end
local out, seen = {}, 0
local function take(e, k)
  local size = 0
  if e[2] then for _, v in ipairs(e[2]) do size = size + #v end end
  seen = seen + size
  if size > cap then
    redis.call('XACK', KEYS[k], 'qrl', e[1])
    redis.call('XDEL', KEYS[k], e[1])
    e = {e[1], size}
  end
  local delivered = 1
  if mode ~= '>' then  -- how often it was delivered: the caller refuses poison
    local p = redis.call('XPENDING', KEYS[k], 'qrl', e[1], e[1], 1)[1]
    delivered = p and p[4] or 0
  end
  out[#out + 1] = {e[1], e[2], delivered, k}
end
if mode == 'claim' then
  local r = call('XAUTOCLAIM', KEYS[1], 'qrl', me, ARGV[6], cursor, 'COUNT', count, 'JUSTID')
  cursor = r[1]
  for i = 1, count do  -- XCLAIM (not JUSTID) fetches it and counts the delivery
    if not r[2][i] then break end
    take(redis.call('XCLAIM', KEYS[1], 'qrl', me, 0, r[2][i])[1] or {r[2][i], false}, 1)
    if seen >= budget then break end
  end
  return {cursor, out, unpack(fixed)}
end
local turn = {}  -- the streams that may hold more, in the order they are asked next
for k = 1, mode == '>' and #KEYS or 1 do turn[k] = k end
while #turn > 0 and #out < count and seen < budget do
  local n, args, index = math.min(#turn, count - #out, 1000), {}, {}
  for i = 1, n do
    args[i], args[n + i], index[KEYS[turn[i]]] = KEYS[turn[i]], mode == '>' and '>' or cursor,
      turn[i]
  end
  local r = call('XREADGROUP', 'GROUP', 'qrl', me, 'COUNT', 1, 'STREAMS', unpack(args))
  turn = {unpack(turn, n + 1)}  -- those not asked first, then those that gave one
  for _, s in ipairs(r or {}) do
    local e = s[2][1]
    if e then
      take(e, index[s[1]])
      turn[#turn + 1], cursor = index[s[1]], e[1]
    end
  end
end
if #turn == 0 then cursor = false end
return {cursor, out, unpack(fixed)}
