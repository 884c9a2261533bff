-- KEYS: the run's control hash, its live-config hash. ARGV: the live version the caller
-- has read already ('' for none), MAX_BYTES. Replies {stop, what, ...}: stop is 1 if the
-- stop flag is set, 0 if not, -1 if the control key is not a hash (the caller repairs it);
-- what is 'none' (no change made), 'same' (the caller's version), 'bad' with why (and the
-- version, if it could be read), or 'new' with version, values, changed, time.
local stop = 0
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'hash' then
  local s = redis.call('HGET', KEYS[1], 'stop')
  if s and s ~= '' then stop = 1 end
elseif kind ~= 'none' then
  stop = -1
end
kind = redis.call('TYPE', KEYS[2]).ok
if kind == 'none' then return {stop, 'none'} end
if kind ~= 'hash' then return {stop, 'bad', 'a ' .. kind .. ', not a hash'} end
if redis.call('HSTRLEN', KEYS[2], 'version') > 20 then
  return {stop, 'bad', 'a version over 20 bytes'}
end
local version = redis.call('HGET', KEYS[2], 'version') or ''
if version ~= '' and version == ARGV[1] then return {stop, 'same'} end
for _, f in ipairs({'values', 'changed', 'time'}) do
  if redis.call('HSTRLEN', KEYS[2], f) > tonumber(ARGV[2]) then
    return {stop, 'bad', f .. ' over ' .. ARGV[2] .. ' bytes', version}
  end
end
local got = redis.call('HMGET', KEYS[2], 'values', 'changed', 'time')
return {stop, 'new', version, got[1] or '', got[2] or '', got[3] or ''}
