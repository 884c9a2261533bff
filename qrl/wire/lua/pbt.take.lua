-- KEYS: a trial's lease. ARGV: worker, lease ms, the longest lease ms. 1 if the lease was
-- free and is now the worker's. A lease no worker could have taken (another type, no end,
-- an end further ahead than any lease can be: a writer's, that would park the trial for
-- good) is free.
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -1 or ttl > tonumber(ARGV[3]) or redis.call('TYPE', KEYS[1]).ok ~= 'string' then
  redis.call('DEL', KEYS[1])
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
