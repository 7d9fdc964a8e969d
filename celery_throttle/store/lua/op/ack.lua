-- ack: the tasks released were sent: their messages go. [P..] tickets
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

-- The tasks released were sent: their time out is OUT_LEASE_MS from now (their messages
-- stay until they start, for one that finds no room then).
local function ack()
  for i = P, #ARGV do
    local ticket = ARGV[i]
    local m = redis.call('ZSCORE', out_key, ticket) and meta_of(ticket)
    if m and m[M.PHASE] == 's' then
      m[M.PHASE] = 'o'
      set_meta(ticket, m)
      redis.call('ZADD', out_key, now + OUT_LEASE_MS * 1000, ticket)
      if redis.call('ZSCORE', slots_key, ticket) then
        redis.call('ZADD', slots_key, now + math.min(OUT_LEASE_MS, HANDED_SLOT_MS) * 1000, ticket)
      end
    end
  end
  return finish(RUN, 0)
end

return ack()
