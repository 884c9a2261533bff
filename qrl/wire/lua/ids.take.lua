-- Take KEYS[1] for ARGV[1] if it still holds ARGV[3] ('' = nothing); ARGV[2] = TTL;
-- returns 0 (not taken), 1 (taken), 2 (taken from garbage).
local cur, garbage = holder(KEYS[1], ARGV[2], true)
if cur ~= ARGV[3] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1 + garbage
