-- A rejected payload recorded (after streams.fix, .xadd_fresh, .count), capped at ARGV[1]
-- entries and counted under 'rejected' and 'rejected:SOURCE'; returns what was repaired.
-- KEYS: dead letters, stats; ARGV: maxlen, source, then the entry's field/value pairs
fix(KEYS[1], 'stream')
fix(KEYS[2], 'hash')
local id = xadd(KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 3))
if type(id) == 'table' then return id end  -- an error (out of memory): raised to the caller
count(KEYS[2], 'rejected')
count(KEYS[2], 'rejected:' .. ARGV[2])
return fixed
