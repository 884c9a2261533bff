-- The rank sampling (after replay.prelude and a records part).
-- KEYS: prio, data; ARGV: 'desc'|'asc', the ranks (0-based, space-separated), RECORDS' own
-- returns {n_present, {id, score, record}...}
-- each rank goes on to ZRANGE as the string it came as (a Lua number would be formatted
-- with %.17g per call), a repeated rank reuses the last lookup, and one HMGET fetches
-- the records
fix_types(TYPES)
local desc = ARGV[1] == 'desc'
local ids, scores, last, m = {}, {}, nil, nil
for r in string.gmatch(ARGV[2], '%d+') do
  if r ~= last then
    if desc then m = redis.call('ZRANGE', KEYS[1], r, r, 'REV', 'WITHSCORES')
    else m = redis.call('ZRANGE', KEYS[1], r, r, 'WITHSCORES') end
    last = r
  end
  if m[1] then ids[#ids + 1] = m[1]; scores[#scores + 1] = m[2] end
end
local out = {}
for s = 1, #ids, 4000 do
  local recs = records(ids, s, math.min(s + 3999, #ids))
  for j = 1, #recs do
    local i = s + j - 1
    out[3 * i - 2] = ids[i]; out[3 * i - 1] = scores[i]; out[3 * i] = recs[j]
  end
end
return {redis.call('ZCARD', KEYS[1]), out}
