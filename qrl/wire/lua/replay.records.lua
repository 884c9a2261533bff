-- A part of the sampling scripts (after replay.prelude, before the sampling): how they fetch
-- the records of ids[s..e] and the types their keys must have (a key of another type is
-- deleted); what it needs of the layout comes last in ARGV (PrioritizedReplay.record_args).
local TYPES = {'zset', 'hash'}
local SIZE = tonumber(ARGV[#ARGV])  -- the record size
-- a record of another size comes back as nil: never sent whole
local function records(ids, s, e)
  local out = redis.call('HMGET', KEYS[2], unpack(ids, s, e))
  for i = 1, #out do
    if out[i] and #out[i] ~= SIZE then out[i] = false end
  end
  return out
end
