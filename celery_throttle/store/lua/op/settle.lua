-- settle: a call that started reports its real cost (ARGV[3], the difference, by rate)
--   for the span it was counted in. [P] at, [P+1] latest, [P+2] epoch (at 0: admitted
--   from a lease, latest its slack), [P+3] batch
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

-- A call that started reports its real cost: the difference (ARGV[3]) is added to (or, a
-- refund, taken from) the span it was counted in, so later starts see what it really
-- used. One counted in another epoch (the state was reset or lost since) has nothing
-- left to settle. A call admitted from a lease ([P] '0': where in the lease's span it is
-- counted is not known) keeps a refund counted, and counts an overrun from now, over
-- [P+1] (its slack), whatever the epoch. A refund lets the line's head go at once.
local function settle()
  expire_out(LINE_BATCH)
  local deltas = per_rate(ARGV[3])
  local at, latest, counted_epoch, batch = tonumber(ARGV[P]), tonumber(ARGV[P + 1]), ARGV[P + 2], tonumber(ARGV[P + 3])
  local from_lease = at == 0
  if from_lease then
    at, latest = now, now + latest
  end
  if from_lease or epoch == counted_epoch then
    for i, r in ipairs(rates) do
      local d = deltas[i]
      -- (counted so long ago that nothing of it counts any more: nothing to settle; and
      -- a refund of a call admitted from a lease stays counted)
      if d ~= 0 and latest + r.period > now and not (from_lease and d < 0) then
        if d > 0 then ALGO.record(r, at, latest, d) else ALGO.unrecord(r, at, latest - at, -d) end
        r.dirty = true
      end
    end
  end
  release_heads(batch)
  return finish(RUN, 0)
end

return settle()
