-- acquire: a fresh call: RUN if nobody waits and it fits (recorded, with a lease if
--   asked and it fits, and a slot for its holder); else QUEUED with its message, DENIED
--   without; TOO_FAR if its wait would pass its max wait. [P] lease, [P+1] lease span,
--   [P+2] holder (a delivery id), then the entry's
-- screen: as acquire, from the consumer: a call that fits is not recorded (the pool's
--   acquire records it). [P..P+2] unused, then the entry's
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function acquire(runs)
  expire_out(LINE_BATCH)
  reclaim()
  local a = entry_at(P + 3)
  a.lease, a.lease_span, a.holder = tonumber(ARGV[P]), tonumber(ARGV[P + 1]), ARGV[P + 2]
  return fresh(runs, a)
end

return too_costly_call() or acquire(op == 'acquire')
