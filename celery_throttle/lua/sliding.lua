-- Sliding window: at most `limit` units start in ANY interval of `period` microseconds.
--
-- Each recorded entry is a span [start, latest]: the task starts somewhere in it. A new
-- entry starting at x is admitted only when every entry with latest > x - period, plus
-- its own cost, stays within the limit. That single check keeps the invariant for every
-- interval, whatever order entries were placed in, so reservations in the future obey it
-- too (see README, "How the windows work").
--
-- To keep memory flat however large the limit, entries are merged into SLOTS buckets per
-- period, keyed by floor(latest / slot). A bucket keeps its total units and the greatest
-- `latest` of what it holds: merging only makes entries look later, which is safe.
--
-- Stored fields: "<prefix><bucket>" = "<units>:<latest>".
local SLOTS = 50

local ALGO, ALGO_TAG = {}, 's'

local function bucket_of(r, latest)
  return string.format('%.0f', math.floor(latest / r.slot))
end

function ALGO.init(r)
  r.slot = math.max(math.ceil(r.period / SLOTS), 1000)
end

function ALGO.decode(r, value, now)
  local units, latest = string.match(value, '^(%d+):(%d+)$')
  units, latest = tonumber(units), tonumber(latest)
  if units == nil or units <= 0 or latest <= now - r.period then
    return nil
  end
  return {units = units, latest = latest}
end

function ALGO.encode(item)
  return string.format('%.0f:%.0f', item.units, item.latest)
end

function ALGO.usage(r, items, x)
  local used = 0
  for _, e in pairs(items) do
    if e.latest > x - r.period then used = used + e.units end
  end
  return used
end

-- Earliest time >= x at which `cost` more units fit. Counts only fall as x grows.
function ALGO.earliest(r, items, x, cost, slack)
  local live, used = {}, 0
  for _, e in pairs(items) do
    if e.latest > x - r.period then
      used = used + e.units
      live[#live + 1] = e
    end
  end
  if used + cost <= r.limit then return x end
  table.sort(live, function(a, b) return a.latest < b.latest end)
  for _, e in ipairs(live) do
    used = used - e.units
    if used + cost <= r.limit then return math.max(x, e.latest + r.period) end
  end
  return x + r.period
end

-- Records `cost` units that start in [at, latest]; returns the latest valid start.
function ALGO.record(r, items, at, latest, cost)
  local b = bucket_of(r, latest)
  local e = items[b]
  if e then
    e.units = e.units + cost
    e.latest = math.max(e.latest, latest)
  else
    items[b] = {units = cost, latest = latest}
  end
  return latest, b, nil
end

-- Gives back a reservation made by record(at, at + grace).
function ALGO.unrecord(r, items, at, grace, cost)
  local b = bucket_of(r, at + grace)
  local e = items[b]
  if e then
    e.units = e.units - cost
    if e.units <= 0 then items[b] = nil end
  end
  return b
end

-- When the last counted unit leaves the window (0 when nothing is counted).
function ALGO.clear_at(r, items)
  local t = 0
  for _, e in pairs(items) do t = math.max(t, e.latest + r.period) end
  return t
end
