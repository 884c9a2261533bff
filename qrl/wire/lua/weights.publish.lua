-- Store version ARGV[1] with blob ARGV[2] if it is newer than the stored one: {1, version};
-- else nothing is written: {0, stored version}. A stored version that is not a whole number
-- from -1 to ARGV[3] (the highest a writer at ARGV[1] counts on from), or a key that is not
-- a hash, is garbage: it is overwritten.
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' and kind ~= 'none' then
  redis.call('DEL', KEYS[1])
end
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
if cur == nil or cur ~= math.floor(cur) or cur < -1 or cur > tonumber(ARGV[3]) then
  cur = -1
end
local version = tonumber(ARGV[1])
if version <= cur then
  return {0, cur}
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'blob', ARGV[2])
return {1, version}
