-- KEYS: a trial's lease, when it was last given back. ARGV: worker, lease ms (0: give it
-- back). 1 if the worker held it.
if redis.call('TYPE', KEYS[1]).ok ~= 'string' or redis.call('STRLEN', KEYS[1]) > 256
   or redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
local now = redis.call('TIME')
redis.call('SET', KEYS[2], tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
return redis.call('DEL', KEYS[1])
