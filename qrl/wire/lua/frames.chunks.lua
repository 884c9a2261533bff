-- The frame replay's records (in place of replay.records): the chunks of ids[s..e], with
-- each id's distance to its chunk's start (ring slot id % CAP); a member that is no id, or a
-- ring entry pointing before id 0, fetches no chunk, and a chunk longer than any chunk can
-- be (MAX_CHUNK) comes back as nil: never sent whole.
local TYPES = {'zset', 'hash', 'string', 'hash'}
local CAP, MAX_CHUNK = tonumber(ARGV[#ARGV - 1]), tonumber(ARGV[#ARGV])
local function records(ids, s, e)
  local out = {}
  for i = s, e do
    local id, rel, chunk = whole(ids[i]), '', false
    if id then
      local at = (id % CAP) * 4
      rel = redis.call('GETRANGE', KEYS[3], at, at + 3)
      if #rel == 4 and struct.unpack('<I4', rel) <= id then
        chunk = redis.call('HGET', KEYS[4], fmt('%d', id - struct.unpack('<I4', rel)))
        if chunk and #chunk > MAX_CHUNK then chunk = false end
      end
    end
    out[#out + 1] = {rel, chunk}
  end
  return out
end
