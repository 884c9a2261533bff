-- The proportional sampling (after replay.prelude and a records part).
-- KEYS: prio, data; ARGV: alpha, lo, ratio, n_buckets, u (increasing, in [0, 1): float64
-- little-endian, concatenated), RECORDS' own
-- returns {n_present, {id, score, record, prob}...}, total mass (%.17g)
fix_types(TYPES)
local alpha, lo = tonumber(ARGV[1]), tonumber(ARGV[2])
-- at most 1,024 buckets whatever ARGV[4] says (qrl sends N_BUCKETS, 133): any role may run
-- this script, and 10^9 buckets would hold Redis for minutes even on an empty key
local ratio, k = tonumber(ARGV[3]), math.min(tonumber(ARGV[4]) or 0, 1024)
local counts, mass, starts = {}, {}, {}
local total, rank = 0, 0
-- bucket b is [edge(b), edge(b + 1)) with edge(b) = lo * ratio^b; both ends are written
-- from the same number with %.17g (exact), so the buckets tile the line: no priority
-- falls between two buckets or into two (tostring, used by '..', keeps only 14 digits)
local edge = fmt('%.17g', lo)
for b = 0, k - 1 do
  local lower = lo * ratio ^ b
  local next_edge = fmt('%.17g', lo * ratio ^ (b + 1))
  local lower_s = (b == 0) and '-inf' or edge
  local upper_s = (b == k - 1) and '+inf' or ('(' .. next_edge)
  edge = next_edge
  local c = redis.call('ZCOUNT', KEYS[1], lower_s, upper_s)
  local w = (lower * math.sqrt(ratio)) ^ alpha
  counts[b] = c; mass[b] = c * w; starts[b] = rank
  rank = rank + c; total = total + c * w
end
local out = {}
if total <= 0 or #ARGV[5] == 0 then return {rank, out, fmt('%.17g', total)} end
-- the u are increasing (stratified), so one walk over the buckets serves every draw
local ids, scores, probs, last, m = {}, {}, {}, nil, nil
local b, acc = 0, 0
for i = 1, #ARGV[5] / 8 do
  local target = struct.unpack('<d', ARGV[5], 8 * i - 7) * total
  while b < k - 1 and (counts[b] == 0 or acc + mass[b] <= target) do
    acc = acc + mass[b]; b = b + 1
  end
  local bb = b
  while counts[bb] == 0 and bb > 0 do bb = bb - 1 end
  local j = math.floor((target - acc) / mass[bb] * counts[bb])
  if j >= counts[bb] then j = counts[bb] - 1 end
  if j < 0 then j = 0 end
  local pos = fmt('%d', starts[bb] + j)
  if pos ~= last then m = redis.call('ZRANGE', KEYS[1], pos, pos, 'WITHSCORES'); last = pos end
  if m[1] then
    ids[#ids + 1] = m[1]; scores[#scores + 1] = m[2]
    probs[#probs + 1] = fmt('%.17g', mass[bb] / counts[bb] / total)
  end
end
for s = 1, #ids, 4000 do
  local recs = records(ids, s, math.min(s + 3999, #ids))
  for j = 1, #recs do
    local i = s + j - 1
    out[4 * i - 3] = ids[i]; out[4 * i - 2] = scores[i]; out[4 * i - 1] = recs[j]
    out[4 * i] = probs[i]
  end
end
return {rank, out, fmt('%.17g', total)}
