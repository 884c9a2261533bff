-- remove consumers ARGV[2..] from group ARGV[1] unless they still hold entries (they would
-- be lost); returns how many left
local n = 0
for i = 2, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i]) == 0 then
    n = n + redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i]) + 1
  end
end
return n
