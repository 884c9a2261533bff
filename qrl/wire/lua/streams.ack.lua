-- Acknowledge and delete entries ARGV[1..] of stream KEYS[1] in one step (a script, not
-- MULTI: Redis out of memory refuses every command queued in a MULTI, while XACK and XDEL
-- free memory).
redis.call('XACK', KEYS[1], 'qrl', unpack(ARGV))
return redis.call('XDEL', KEYS[1], unpack(ARGV))
