-- peek: usage and the line, nothing written
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function peek()
  local x = earliest(math.max(now, not_before), call_units, out_per_rate())
  local wait = (x or now + shortest) - now
  if waiting > 0 then wait = math.max(wait, wait_of(call_units)) end
  return finish((x == now and waiting == 0) and RUN or DENIED, wait, nil, false, true)
end

return too_costly_call() or peek()
