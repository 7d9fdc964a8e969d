-- release: release the heads that fit. [P] batch
-- (One script: the loader puts window.lua and line.lua, each function this file reaches,
-- before it; line.lua's header says what the keys, the arguments and the replies are.)

local function release()
  expire_out(LINE_BATCH)
  reclaim()
  release_heads(tonumber(ARGV[P]))
  return finish(RUN, 0, nil, true)
end

return release()
