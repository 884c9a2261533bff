-- Entries no consumer will ever be handed: in the stream, at or below the group's
-- last-delivered id, yet pending for nobody (someone moved the group's id with XGROUP
-- SETID, or acknowledged what a dead consumer held). They would hold the producers' room for
-- good: claim them for consumer ARGV[1] as idle for ARGV[5] ms, so its next claim scan hands
-- them out. Looks at up to ARGV[3] entries (at most MAX_ENTRIES, set before it: any role may
-- run this script, and one asking for 10^9 entries of a long stream would hold Redis for
-- minutes) after ARGV[2] ('-': from the start), one at a time, stopping after ARGV[3] x
-- ARGV[4] bytes; returns {next cursor ('-' when done), claimed}.
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
