-- ARGV[3] 'keep': keep KEYS[1] for ARGV[1] another ARGV[2] seconds (taking it again if it
-- ran out or holds garbage), unless another holds it; 'release': delete it if ARGV[1] does.
local cur = holder(KEYS[1], ARGV[2], true)
if cur ~= '' and cur ~= ARGV[1] then return 0 end
if ARGV[3] == 'release' then return redis.call('DEL', KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
