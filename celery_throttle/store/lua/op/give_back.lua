-- give_back: a released task will not start (discarded as expired or revoked): its room
--   comes back (not a start granted ahead whose time has come: its process took it).
--   [P] ticket, [P+1] batch, [P+2] '1': handed back (never acked: back in its place),
--   '2': it started in shadow mode (its room comes back, and it is used: DUPLICATE for
--   a copy)
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

-- The task released with a ticket will not start (expired, revoked): it is forgotten. Or
-- [P+2] '1', handed back (the worker it was handed to has no process for it): never acked,
-- it goes back in its place, to go again at once; anything else is left as it is (a copy
-- of one released again since, which the other copy claims).
local function give_back()
  expire_out(LINE_BATCH)
  reclaim()
  local ticket, batch = ARGV[P], tonumber(ARGV[P + 1])
  local m = redis.call('ZSCORE', out_key, ticket) and meta_of(ticket)
  if ARGV[P + 2] == '2' then
    -- Started outside the rules (its throttle went to shadow mode): its room comes back,
    -- and it counts as used, so that a copy of its message is a DUPLICATE, as after a start.
    if used(ticket) then return finish(DUPLICATE, 0) end
    if m then
      come_in(ticket, m)
      ungrant(m)
      drop_slots(ticket)
      forget(ticket)
    end
    use(ticket, '')
  elseif ARGV[P + 2] == '1' then
    if m and m[M.PHASE] == 's' and redis.call('HEXISTS', msgs_key, ticket) == 1 then
      come_in(ticket, m)
      drop_slots(ticket)
      join(ticket, m, m[M.PLACE])
    end
  -- (A start granted ahead whose time has come was taken by its process: it stays.)
  elseif m and not (m[M.PHASE] == 'g' and now >= m[M.START]) then
    come_in(ticket, m)
    ungrant(m)
    drop_slots(ticket)
    forget(ticket)
  end
  release_heads(batch)
  return finish(RUN, 0)
end

return give_back()
