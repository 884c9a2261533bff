-- The holders of leases KEYS (bounded: one chunk of numbers), garbage as ''; ARGV[1] = TTL.
local out = {}
for i, key in ipairs(KEYS) do out[i] = holder(key, ARGV[1], false) end
return out
