-- A part of the pool's scripts. current(): KEYS[1], the forming generation, if it is a
-- valid one of ARGV[3] learners, else '' (none, another type or size, garbage); count(i):
-- KEYS[i]'s count, nil if gone or garbage.
local function valid(i, len, pattern)
  local ok = redis.call('TYPE', KEYS[i])['ok'] == 'string' and redis.call('STRLEN', KEYS[i]) <= len
  local value = ok and redis.call('GET', KEYS[i])
  return value and string.match(value, pattern) and value
end
local function current()
  local gen = valid(1, 32, '^%x+%.%d+$')
  return (gen and string.match(gen, '%.(%d+)$') == ARGV[3]) and gen or ''
end
local function count(i) return tonumber(valid(i, 6, '^[1-9]%d*$')) end
