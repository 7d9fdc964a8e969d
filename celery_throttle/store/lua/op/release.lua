-- release: release the heads that fit. [P] batch, [P+1..] tickets of the releaser's last
--   release of this key that it sent since (acked first, as ack's)
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function release()
  ack_sent(P + 1)
  expire_out(LINE_BATCH)
  reclaim()
  release_heads(tonumber(ARGV[P]))
  return finish(RUN, 0, nil, true)
end

return release()
