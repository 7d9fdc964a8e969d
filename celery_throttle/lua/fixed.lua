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

-- Earliest time >= x at which `cost` more units fit. A start at t may happen up to
-- `slack` later: when that crosses into the next window, it must fit in both.
function ALGO.earliest(r, items, x, cost, slack)
  local k = math.floor(x / r.period)
  while true do
    local t = math.max(x, k * r.period)
    local fits = (items[string.format('%.0f', k)] or 0) + cost <= r.limit
    if fits and math.floor((t + slack) / r.period) > k then
      fits = (items[string.format('%.0f', k + 1)] or 0) + cost <= r.limit
    end
    if fits then return t end
    k = k + 1
  end
end

-- Records `cost` units starting in [at, latest], in each window that span touches (at
-- most two: `latest - at` is a small slack or grace); returns the latest valid start.
function ALGO.record(r, items, at, latest, cost)
  local w, w2 = window_of(r, at), window_of(r, latest)
  items[w] = (items[w] or 0) + cost
  if w2 ~= w then
    items[w2] = (items[w2] or 0) + cost
  else
    w2 = nil
  end
  return (tonumber(w) + 1) * r.period - 1, w, w2
end

local function take_back(items, w, cost)
  local units = items[w]
  if units then
    units = units - cost
    if units <= 0 then units = nil end
    items[w] = units
  end
end

function ALGO.unrecord(r, items, at, grace, cost)
  local w, w2 = window_of(r, at), window_of(r, at + grace)
  take_back(items, w, cost)
  if w2 ~= w then
    take_back(items, w2, cost)
  else
    w2 = nil
  end
  return w, w2
end

function ALGO.clear_at(r, items)
  local t = 0
  for w, _ in pairs(items) do t = math.max(t, (tonumber(w) + 1) * r.period) end
  return t
end
