-- A part of the lease scripts. holder(key, ttl, repair): who holds lease ``key``, '' if
-- none, and 1 if it held garbage: a lease qrl did not write (another Redis type, no TTL, a
-- TTL longer than ``ttl``: anyone with the run's keys can make one), which counts as free,
-- and with ``repair`` is deleted.
local function holder(key, ttl, repair)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then return '', 0 end
  local left = redis.call('TTL', key)
  if kind == 'string' and left >= 0 and left <= tonumber(ttl) then
    return redis.call('GET', key), 0
  end
  if repair then redis.call('DEL', key) end
  return '', 1
end
