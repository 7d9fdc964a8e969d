-- ended: a body ended: its holder's slot goes. [P] holder, [P+1] batch
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function ended()
  local holder, batch = ARGV[P], tonumber(ARGV[P + 1])
  local held = any_slots() and redis.call('ZREM', slots_key, holder) == 1
  expire_out(LINE_BATCH)
  reclaim()
  release_heads(batch)
  return finish(held and RUN or LOST, 0)
end

return ended()
