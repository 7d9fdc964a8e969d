-- shadow: a call of a throttle in shadow mode, on its key's shadow keys: where
--   enforcing would have started it, recorded there, nothing held (see shadow()). [P]
--   holder ('' none), [P+1] max wait (µs, 0 none)
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

-- A call of a throttle in shadow mode, run on its key's shadow keys (the caller names
-- them: never the key's own state, line or slots). The start enforcing would have given
-- it: first come first served after the last call shadowed (field 'l'), not before a
-- pause's end, at the earliest every rate admits it; recorded there at that start. With a
-- concurrency limit, its holder joins the shadow slots whatever their number (its body
-- runs: `running` says how many shadowed bodies ran beside it, and `held` that it holds
-- one, for its process to renew and end). DENIED with the wait where it would have
-- waited; TOO_FAR past its max wait (not recorded: enforcing would have refused it);
-- else RUN. Its counts ('n' checks, 'h' held back, 'w' µs they would have waited in all,
-- 'm' the longest) are what `throttle status` shows. [P] holder ('' none), [P+1] max wait
-- (µs, 0 none)
local function shadow()
  local holder, max_wait = ARGV[P], tonumber(ARGV[P + 1])
  -- (Its last start and its counts, read and written at once.)
  local seen = redis.call('HMGET', key, 'l', 'n', 'h', 'w', 'm')
  for i = 1, 5 do seen[i] = tonumber(seen[i] or '0') or 0 end
  local from = math.max(now, not_before, seen[1])
  -- (Rates that never settle on a start: a window past where it would have waited.)
  local x = earliest(from, call_units) or from + shortest
  local running, held = 0, 0
  if concurrency > 0 then
    reclaim()
    running = slots_held()
    if holder ~= '' then
      redis.call('ZADD', slots_key, now + slot_lease, holder)
      held = 1
    end
  end
  local wait, code = x - now, RUN
  if max_wait > 0 and wait > max_wait then
    code = TOO_FAR
  else
    if x > now or running >= concurrency and concurrency > 0 then code = DENIED end
    if #rates > 0 then
      record(x, x + slack, call_units)
      seen[1] = x
    end
  end
  seen[2] = seen[2] + 1
  if code ~= RUN then
    seen[3], seen[4], seen[5] = seen[3] + 1, seen[4] + math.floor(wait), math.max(seen[5], wait)
  end
  redis.call('HSET', key, 'l', string.format('%.0f', seen[1]), 'n', string.format('%.0f', seen[2]),
             'h', string.format('%.0f', seen[3]), 'w', string.format('%.0f', seen[4]),
             'm', string.format('%.0f', seen[5]))
  local reply = finish(code, wait, {start_us = x, latest_us = x + slack, held = held, running = running})
  -- (The counts last while anything of the key's shadow does, and a slot's lease at least:
  -- a throttle of slots alone writes no window that would keep them.)
  local ttl = math.ceil(math.max(shortest, slot_lease) / 1000) + STATE_TTL_PAD_MS
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  return reply
end

return too_costly_call() or shadow()
