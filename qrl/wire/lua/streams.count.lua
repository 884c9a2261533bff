-- A part. count(key, f): add 1 to counter f of hash key. One HINCRBY refuses (someone left
-- a non-number, or a count at the int64 edge) starts again from 1, with what an actor's
-- user may run where it can (HINCRBY of the count's negation: it has no HSET), else with
-- HSET.
local function count(key, f)
  if type(redis.pcall('HINCRBY', key, f, 1)) ~= 'table' then return end
  local v = redis.call('HGET', key, f)
  local undone = v and string.match(v, '^%d+$') and redis.pcall('HINCRBY', key, f, '-' .. v)
  if type(undone) ~= 'number' then redis.pcall('HSET', key, f, 0) end
  redis.pcall('HINCRBY', key, f, 1)
end
