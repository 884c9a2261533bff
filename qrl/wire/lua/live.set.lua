-- KEYS: the live-config hash. ARGV: the version the setter read ('' where there was none
-- or it was unreadable), then the new version, values, changed, time. Written (the hash
-- made afresh) only if the stored version is still ARGV[1], one of another type or over 20
-- bytes reading as '': 1; else 0, and nothing is written.
local kind = redis.call('TYPE', KEYS[1]).ok
local version = ''
if kind == 'hash' then version = redis.call('HGET', KEYS[1], 'version') or '' end
if string.len(version) > 20 then version = '' end
if version ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'values', ARGV[3], 'changed', ARGV[4],
  'time', ARGV[5])
return 1
