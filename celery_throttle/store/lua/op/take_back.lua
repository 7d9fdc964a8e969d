-- take_back: the journal says these entries left their lines for good (released and sent
--   to the broker) a while ago, and the store holds them again: a failover to a replica
--   short of their release, or a releaser that died between its send and its ack. Each
--   released and not acked (at its send lease's end it would go back to its place, its
--   releaser taken for dead before its send) leaves for good, and so does one of the first
--   [P] entries still in its line, each reported 'k'; one released and acked (its worker
--   holds its message) stays, and so does one started (its start is what drops a copy), or
--   one of the others in its line (it may have been put back since: its copy follows).
--   [P] how many of the entries may leave the line, [P+1..] entries
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function take_back()
  local lined = P + tonumber(ARGV[P])
  for i = P + 1, #ARGV do
    local id = ARGV[i]
    local m = meta_of(id)
    if i <= lined and redis.call('ZSCORE', line_key, id) then
      leave(id, m)
      forget(id)
      report(id, m and m[M.TASK] or id, 'k')
    elseif m and m[M.PHASE] == 's' and redis.call('ZSCORE', out_key, id) then
      come_in(id, m)
      drop_slots(id)
      forget(id)
      report(id, m[M.TASK], 'k')
    end
  end
  return finish(RUN, 0)
end

return take_back()
