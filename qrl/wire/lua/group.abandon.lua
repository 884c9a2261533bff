-- KEYS gen, joined:GEN, store:GEN; ARGV -, -, world: a member gives up before its
-- generation is full: delete it, so that the others stop waiting and nobody joins it (the
-- next join finds no count under learners:gen and starts a new generation).
local n = count(2)
if n and n >= tonumber(ARGV[3]) then return 0 end
return redis.call('UNLINK', KEYS[2], KEYS[3])  -- O(1) whatever a writer planted
