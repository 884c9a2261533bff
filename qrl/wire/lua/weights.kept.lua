-- 1 if KEYS[1] is a hash holding version ARGV[1] and a blob of ARGV[3] bytes whose SHA1 is
-- ARGV[2], else 0. Redis hashes the blob (the check sends no parameters), and only one of
-- the publisher's own length: a writer's huge blob costs no hashing.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash'
    or redis.call('HGET', KEYS[1], 'version') ~= ARGV[1]
    or redis.call('HSTRLEN', KEYS[1], 'blob') ~= tonumber(ARGV[3]) then
  return 0
end
if redis.sha1hex(redis.call('HGET', KEYS[1], 'blob')) ~= ARGV[2] then
  return 0
end
return 1
