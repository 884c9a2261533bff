-- The functions every replay script starts with (KEYS: prio, data, meta, batches, ...).
-- Each script is one atomic step, so readers never see half an insert or an eviction. A
-- writer with the run's keys can store anything in the replay's keys, so nothing stored
-- decides how much a script does: these check every stored number and repair what is out
-- of range, in bounded work.
local EXTRA = 4096  -- ids a call may evict beyond its own batch (a lowered capacity)
local MAX_ID = 1e15  -- ids stay exact in a Lua double and print with %d
local fmt = string.format
-- a stored whole number in [0, MAX_ID] (0 if missing), else nil: garbage
local function whole(v)
  if not v then return 0 end
  if #v > 16 or not string.match(v, '^%d+$') then return nil end
  local x = tonumber(v)
  if x > MAX_ID then return nil end
  return x
end
-- delete each KEYS[i] whose type is not types[i] (a writer's key of another type); how many
local function fix_types(types)
  local fixed = 0
  for i, t in ipairs(types) do
    local k = redis.call('TYPE', KEYS[i])['ok']
    if k ~= t and k ~= 'none' then redis.call('UNLINK', KEYS[i]); fixed = fixed + 1 end
  end
  return fixed
end
-- cmd key list... in slices (unpack takes a few thousand values at most)
local function each(cmd, key, list)
  for s = 1, #list, 4000 do redis.call(cmd, key, unpack(list, s, math.min(s + 3999, #list))) end
end
-- the meta's next id (hi) and oldest id present (lo) for an insert into a replay of cap,
-- and 1 if they were garbage and were repaired. Consistent meta has 0 <= lo <= hi and
-- hi - lo <= cap (up to EXTRA more after the capacity was lowered); anything else would
-- make the eviction walk an unbounded range. Ids left below a repaired lo stay (at most
-- a capacity's worth, once per repair) and a repaired hi may overwrite ids: both bounded.
-- A repaired hi starts again from lo, or from 0 if lo is past half of MAX_ID (else ids
-- could run past MAX_ID at every insert, and every insert repair them to the same lo).
local function span(cap)
  local m = redis.call('HMGET', KEYS[3], 'hi', 'lo')
  local hi, lo, bad = whole(m[1]), whole(m[2]), 0
  if not hi then hi, bad = (lo and lo < MAX_ID / 2) and lo or 0, 1 end
  if not lo or lo > hi or hi - lo > cap + EXTRA then lo, bad = math.max(0, hi - cap), 1 end
  return hi, lo, bad
end
-- add by to the meta's counter field, from 0 again if it held garbage
local function bump(field, by)
  if not whole(redis.call('HGET', KEYS[3], field)) then redis.call('HDEL', KEYS[3], field) end
  return redis.call('HINCRBY', KEYS[3], field, by)
end
-- the start of an insert of n into a replay of cap (ARGV[2]: its batch id, '' for none),
-- KEYS of the given types: the first new id (nil: the batch was inserted already), lo and
-- the number of repairs made
local function begin(types, cap, n)
  local repaired = fix_types(types)
  if ARGV[2] ~= '' and redis.call('ZSCORE', KEYS[4], ARGV[2]) then return nil, nil, repaired end
  local first, lo, bad = span(cap)
  if ARGV[2] ~= '' then
    redis.call('ZADD', KEYS[4], first + n, ARGV[2])
    bump('batches', 1)
  end
  return first, lo, repaired + bad
end
-- forget up to limit batch ids whose transitions are all gone (all below lo)
local function forget_batches(lo, limit)
  local below = '(' .. fmt('%d', lo + 1)
  each('ZREM', KEYS[4], redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', below, 'LIMIT', 0, limit))
end
