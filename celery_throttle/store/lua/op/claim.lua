-- claim: a released task arrives: RUN, RUN_AT (`start`), back in line (QUEUED, with its
--   message kept or given; DENIED without), WAITED (it waited past its max wait: it
--   leaves); an unknown ticket is a fresh call. [P] ticket, [P+1] how early it may come
--   at most (µs), [P+2] holder (its delivery: the slot handed to the ticket becomes the
--   holder's), [P+3] the start granted to this process earlier, which it woke too late
--   for (0: none), then its entry as a fresh call's, then [P+12] '1' if it may be told
--   STALE (released under other controls than the caller's, it would go back: the
--   caller reads them and claims again with '0')
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function claim()
  expire_out(LINE_BATCH)
  reclaim()
  write_back()  -- (what expire_out gave back stays given back, whatever this claim does)
  return arrive(ARGV[P], tonumber(ARGV[P + 1]), ARGV[P + 2], tonumber(ARGV[P + 3]), entry_at(P + 4),
                ARGV[P + 12] == '1')
end

return claim()
