-- A follower's read of a stream it has no group on (the metrics): up to ARGV[2] entries
-- after id ARGV[1], one at a time, each measured here: one over ARGV[3] bytes (fields and
-- values) comes back as its size only, never whole. Stops once ARGV[4] bytes were examined
-- (bounded work whatever the entries hold). Nothing comes after LAST_ID, the largest stream
-- id there is (set before it; '(' of it is an error). Returns {newest, {{id, fields or
-- size}...}}. newest is false unless ARGV[5] is '1', nothing came and ARGV[1] is ahead of
-- Redis's clock (an id someone chose: honest ones never are): then it is the stream's last
-- entry id, which the caller compares with ARGV[1] (ids pass 2^53, which Lua's numbers do
-- not hold) to see a stream deleted and started afresh under it. Only then is the last
-- entry loaded (it may be big): the caller asks at most once a second.
local out, seen, cursor = {}, 0, ARGV[1]
-- at most 1,000 entries a call whatever ARGV[2] says (MetricsReader.COUNT): any role may run
-- this script, and one that asked for 10^9 over a long stream would hold Redis for minutes
for _ = 1, math.min(tonumber(ARGV[2]) or 0, 1000) do
  if cursor == LAST_ID then break end
  local e = redis.call('XRANGE', KEYS[1], '(' .. cursor, '+', 'COUNT', 1)[1]
  if not e then break end
  cursor = e[1]
  local size = 0
  for _, v in ipairs(e[2]) do size = size + #v end
  if size > tonumber(ARGV[3]) then e = {cursor, size} end
  out[#out + 1] = e
  seen = seen + size
  if seen >= tonumber(ARGV[4]) then break end
end
local newest = false
if #out == 0 and ARGV[5] == '1' then
  local now = redis.call('TIME')
  if tonumber(string.match(ARGV[1], '^%d+')) > now[1] * 1000 + 1000 then
    local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
    newest = last and last[1] or false
  end
end
return {newest, out}
