-- drain: release the heads whatever the room (throttling switched off, or taken down by
--   an operator). [P] batch, [P+1..] tickets sent since the last release (as release's)
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function drain()
  ack_sent(P + 1)
  expire_out(LINE_BATCH)
  release_heads(tonumber(ARGV[P]), true)
  return finish(RUN, 0, nil, true)
end

return drain()
