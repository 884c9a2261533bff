-- A part of the scripts that repair what they write to (qrl.wire.stream_scripts.REPAIRS)
-- and of others. fix(key, want): a key of another type where a stream or hash of ours
-- belongs was written by someone else: delete it and say so (in ``fixed``, for the caller's
-- one warning). UNLINK frees a big one in the background; an actor's ACL user may only DEL.
local fixed = {}
local function fix(key, want)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= want then
    if type(redis.pcall('UNLINK', key)) == 'table' then redis.call('DEL', key) end
    fixed[#fixed + 1] = key .. ' was a ' .. t .. ', not a ' .. want .. ' (wrong type): deleted'
  end
end
