-- A part (after streams.fix). xadd(key, ...): XADD key ...; a stream someone gave the last
-- possible id (XADD KEY 18446744073709551615-18446744073709551615 ...) has no id left for
-- '*', ever: it is deleted, with its entries and its consumer group's pending ones (they are
-- lost), and added to afresh (noted in streams.fix's ``fixed``). Returns XADD's reply (an
-- error as a table) and whether the stream is new.
local function xadd(key, ...)
  local id = redis.pcall('XADD', key, ...)
  if type(id) == 'table' and id.err and string.find(id.err, 'exhausted') then
    redis.call('DEL', key)
    fixed[#fixed + 1] = key .. ' had used up its ids: deleted and recreated'
    return redis.pcall('XADD', key, ...), true
  end
  return id, false
end
