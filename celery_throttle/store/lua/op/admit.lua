-- admit: at publish: RUN (nothing recorded) if the entry came without its message (the
--   producer's budget of unchecked sends is not spent), nobody waits, nothing is out
--   and every rate stays at most half full (`leased`, the room before one is; `rooms`,
--   each rate's); else RELEASED if it fits now (its own entry id is its ticket, no
--   message kept); else as acquire. [P..] the entry's
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function admit()
  expire_out(LINE_BATCH)
  reclaim()
  local a = entry_at(P)
  local code, wait, f = RUN, 0, {}
  if known_entry(a.id) then
    code = QUEUED
  elseif used(a.id) then
    code = DUPLICATE
  elseif a.message == '' and waiting == 0 and out_count == 0 and not_before == 0 and slot_free()
      and lease_fits(nil, slack) then
    -- (lease_fits: at most half of each rate used with this call, so the room is >= cost)
    local room, rooms = nil, {}
    for i, r in ipairs(rates) do
      local used = math.max(ALGO.usage(r, now), ALGO.usage(r, now + slack))
      local free = math.floor(r.limit / 2) - used
      if room == nil or free < room then room = free end
      rooms[i] = free
    end
    if concurrency > 0 and n_rates == 0 then room = math.max(slot_cap - slots_held(), 0) end  -- (slots alone)
    f.leased, f.rooms = room or 0, costs and table.concat(rooms, ',') or ''
  elseif fresh_fits() then
    code = RELEASED
    go_out(a.id, new_meta(a.task, a.expires, a.max_wait), 'o', now + OUT_LEASE_MS * 1000)
  else
    code, wait = wait_in_line(a, false)
  end
  release_heads(a.batch)
  return finish(code, wait, f)
end

return too_costly_call() or admit()
