-- drain: release the heads whatever the room (throttling switched off, or taken down by
--   an operator). [P] batch
-- (One script: the loader puts window.lua and line.lua, each function this file reaches,
-- before it; line.lua's header says what the keys, the arguments and the replies are.)

local function drain()
  expire_out(LINE_BATCH)
  release_heads(tonumber(ARGV[P]), true)
  return finish(RUN, 0, nil, true)
end

return drain()
