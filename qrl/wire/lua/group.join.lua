-- KEYS gen, joined:SEEN, joined:NEW; ARGV seen ('' none), new, world, ttl: {gen, count}, or
-- {'', 0} if the generation moved on since the client looked.
if current() ~= ARGV[1] then return {'', 0} end
local n = ARGV[1] ~= '' and count(2)
if n and n < tonumber(ARGV[3]) then
  n = redis.call('INCR', KEYS[2])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return {ARGV[1], n}
end
redis.call('UNLINK', KEYS[1])  -- what was there (a huge planted value) freed off the main thread
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[4])
redis.call('SET', KEYS[3], 1, 'EX', ARGV[4])
return {ARGV[2], 1}
