-- Switch the manifest hash KEYS[1] to version ARGV[1] with manifest ARGV[2], whose chunks
-- (qrl/wire/chunks.py) are KEYS[2..], written before under token ARGV[4] with an expiry (a
-- writer that died half-way leaves nothing that lasts): {1, version, token, count} of the
-- version two back, whose chunks the writer deletes now (readers of the version before
-- finish it). Not newer than the stored version: nothing is written, {0, stored version}.
-- A chunk gone (expired: the writer was too slow): {-1, stored version}.
-- A stored version that is not a whole number from -1 to ARGV[3] (the highest a writer at
-- ARGV[1] counts on from), or a key that is not a hash, is garbage: it is overwritten.
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
for i = 2, #KEYS do
  if redis.call('PERSIST', KEYS[i]) == 0 and redis.call('EXISTS', KEYS[i]) == 0 then
    return {-1, cur}
  end
end
local was = redis.call('HMGET', KEYS[1], 'token', 'count', 'prev_token', 'prev_count')
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'blob', ARGV[2], 'token', ARGV[4],
  'count', #KEYS - 1, 'prev_token', was[1] or '', 'prev_count', was[2] or '0')
return {1, version, was[3] or '', was[4] or '0'}
