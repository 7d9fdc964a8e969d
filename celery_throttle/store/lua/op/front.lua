-- front: Backoff: the entry joins the line before everyone. [P..] the entry's
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function front()
  expire_out(LINE_BATCH)
  local a = entry_at(P)
  if not known_entry(a.id) then enqueue(a.id, a.message, new_meta(a.task, a.expires, a.max_wait), true) end
  release_heads(a.batch)
  return finish(QUEUED, 0)
end

return too_costly_call() or front()
