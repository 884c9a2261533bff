-- 1 if KEYS[1] is a hash holding version ARGV[1] and a manifest of ARGV[3] bytes whose SHA1
-- is ARGV[2], and each chunk KEYS[i] (i >= 2) is a string of ARGV[4 + i] bytes, the one of
-- index ARGV[4] (1-based among the chunks; 0: none) with SHA1 ARGV[5]; else 0. Redis hashes
-- (the check sends no parameters), and only one of the publisher's own lengths: a writer's
-- huge value costs no hashing, and one chunk a call bounds the work (the publisher checks
-- its chunks in turn).
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash'
    or redis.call('HGET', KEYS[1], 'version') ~= ARGV[1]
    or redis.call('HSTRLEN', KEYS[1], 'blob') ~= tonumber(ARGV[3]) then
  return 0
end
if redis.sha1hex(redis.call('HGET', KEYS[1], 'blob')) ~= ARGV[2] then
  return 0
end
for i = 2, #KEYS do
  if redis.call('TYPE', KEYS[i])['ok'] ~= 'string'
      or redis.call('STRLEN', KEYS[i]) ~= tonumber(ARGV[4 + i]) then
    return 0
  end
end
local j = tonumber(ARGV[4])
if j > 0 and redis.sha1hex(redis.call('GET', KEYS[j + 1])) ~= ARGV[5] then
  return 0
end
return 1
