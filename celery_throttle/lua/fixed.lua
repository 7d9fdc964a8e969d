-- Fixed window: at most `limit` units start in each aligned window
-- [k * period, (k + 1) * period). A burst across a boundary can reach 2 x limit in one
-- period's length: that is the algorithm's nature, kept for quotas where it is fine.
--
-- Stored fields: "<prefix><k>" = "<units>", one per window that holds units (the current
-- one and any future window holding reservations).
local ALGO, ALGO_TAG = {}, 'f'

local function window_of(r, t)
  return string.format('%.0f', math.floor(t / r.period))
end

function ALGO.init(r) end

function ALGO.decode(r, value, now, suffix)
  local units, k = tonumber(value), tonumber(suffix)
  if units == nil or k == nil or units <= 0 or k < math.floor(now / r.period) then
    return nil
  end
  return units
end

function ALGO.encode(units)
  return string.format('%.0f', units)
end

function ALGO.usage(r, items, x)
  return items[window_of(r, x)] or 0
end

-- Earliest time >= x at which `cost` more units fit: the first window with room, and
-- far enough from its end that a start up to `slack` later still falls inside it.
function ALGO.earliest(r, items, x, cost, slack)
  local k = math.floor(x / r.period)
  if x + slack >= (k + 1) * r.period then k = k + 1 end
  while (items[string.format('%.0f', k)] or 0) + cost > r.limit do
    k = k + 1
  end
  return math.max(x, k * r.period)
end

-- Records `cost` units in the window of `at`; returns the latest valid start.
function ALGO.record(r, items, at, latest, cost)
  local w = window_of(r, at)
  items[w] = (items[w] or 0) + cost
  return (tonumber(w) + 1) * r.period - 1, w
end

function ALGO.unrecord(r, items, at, grace, cost)
  local w = window_of(r, at)
  local units = items[w]
  if units then
    units = units - cost
    if units <= 0 then units = nil end
    items[w] = units
  end
  return w
end

function ALGO.clear_at(r, items)
  local t = 0
  for w, _ in pairs(items) do t = math.max(t, (tonumber(w) + 1) * r.period) end
  return t
end
