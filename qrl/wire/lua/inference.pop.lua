-- A server's pop of its actors' requests (after streams.fix).
-- pop up to ARGV[1] requests from the lists KEYS (one per actor), at most ARGV[3] from each;
-- one bigger than ARGV[2] bytes is dropped and only its size returned. Stops once ARGV[1] x
-- ARGV[2] bytes were examined. Returns {{list index, request or size, ...}}, then what was
-- repaired. An empty list costs one LPOP: the type is looked at only when that fails.
-- any role may run this script: the counts are bounded whatever ARGV says, so no call pops
-- more than 4,096 requests, nor more than 32 of one list (a server asks for EACH x its actors' batches)
local count, cap = math.min(tonumber(ARGV[1]) or 0, 4096), tonumber(ARGV[2])
local each = math.min(tonumber(ARGV[3]) or 0, 32)
local out, seen, n = {}, 0, 0
for i, key in ipairs(KEYS) do
  for _ = 1, each do
    local v = redis.pcall('LPOP', key)
    if type(v) == 'table' then fix(key, 'list') break end
    if not v then break end
    seen, n = seen + #v, n + 1
    out[#out + 1] = i - 1
    if #v > cap then out[#out + 1] = #v else out[#out + 1] = v end
    if n >= count or seen >= count * cap then return {out, unpack(fixed)} end
  end
end
return {out, unpack(fixed)}
