-- (After streams.fix.) The consumer group 'qrl' on stream KEYS[1], and the stream, made if
-- missing; a key of another type in the stream's place is deleted first. Returns what was
-- repaired, or XGROUP's error.
fix(KEYS[1], 'stream')
local ok = redis.pcall('XGROUP', 'CREATE', KEYS[1], 'qrl', '0', 'MKSTREAM')
if type(ok) == 'table' and ok.err and not string.find(ok.err, 'BUSYGROUP') then return ok end
return fixed
