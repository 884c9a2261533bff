-- A producer's add (after streams.fix, .xadd_fresh, .count): XADD ARGV[2] to stream KEYS[1]
-- if fewer than ARGV[1] entries wait undelivered, counting it under ARGV[3] in the stats
-- hash KEYS[2] (if given). Returns {entry id or false (no room), what was repaired...}, or
-- XADD's error (out of memory).
fix(KEYS[1], 'stream')
if KEYS[2] then fix(KEYS[2], 'hash') end
-- entries waiting = in the stream and not yet delivered to a consumer (XLEN - pending):
-- what consumers hold while assembling a batch must not count, or they could wait forever
local waiting = redis.call('XLEN', KEYS[1])
local pending = redis.pcall('XPENDING', KEYS[1], 'qrl')
if type(pending) == 'table' and pending.err == nil then waiting = waiting - pending[1] end
if waiting >= tonumber(ARGV[1]) then return {false, unpack(fixed)} end
local id, fresh = xadd(KEYS[1], '*', 'd', ARGV[2])
-- a stream started afresh gets its group back (or its consumers recreate it: an actor's
-- user may not)
if fresh then redis.pcall('XGROUP', 'CREATE', KEYS[1], 'qrl', '0', 'MKSTREAM') end
if type(id) == 'table' then return id end  -- an error (out of memory): nothing was added
-- count every entry ever added, in the same step (the run's stats hash, if given)
if KEYS[2] then count(KEYS[2], ARGV[3]) end
return {id, unpack(fixed)}
