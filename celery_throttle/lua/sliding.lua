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
-- State of one rate: a flat list {latest, units, latest, units, ...} sorted by latest
-- (so by bucket), stored MessagePack-encoded in one hash field: one C call decodes it,
-- where a field per bucket cost a Lua string match each.
local SLOTS = 100

local ALGO = {}

function ALGO.init(r)
  r.slot = math.max(math.ceil(r.period / SLOTS), 1000)
end

-- What can still count at `now`: entries with latest > now - period (a prefix is not).
function ALGO.load(r, t, now)
  local cut, n, first = now - r.period, #t, 1
  while first < n and t[first] <= cut do first = first + 2 end
  if first == 1 then return t end
  local out = {}
  for i = first, n do out[#out + 1] = t[i] end
  return out
end

function ALGO.usage(r, t, x)
  local cut, used = x - r.period, 0
  for i = #t - 1, 1, -2 do
    if t[i] <= cut then break end
    used = used + t[i + 1]
  end
  return used
end

-- Earliest time >= x at which `cost` more units fit. Counts only fall as x grows.
function ALGO.earliest(r, t, x, cost, slack)
  local used = ALGO.usage(r, t, x)
  if used + cost <= r.limit then return x end
  local cut = x - r.period
  for i = 1, #t - 1, 2 do
    if t[i] > cut then
      used = used - t[i + 1]
      if used + cost <= r.limit then return math.max(x, t[i] + r.period) end
    end
  end
  return x + r.period
end

-- Index of the bucket holding `latest`, or of the last entry before it (0 if none).
local function find(r, t, latest)
  local b = math.floor(latest / r.slot)
  local i = #t - 1
  while i >= 1 and math.floor(t[i] / r.slot) > b do i = i - 2 end
  return i, i >= 1 and math.floor(t[i] / r.slot) == b
end

-- Records `cost` units that start in [at, latest]; returns the latest valid start.
function ALGO.record(r, t, at, latest, cost)
  local i, found = find(r, t, latest)
  if found then
    t[i + 1] = t[i + 1] + cost
    if latest > t[i] then t[i] = latest end
  else
    table.insert(t, i + 2, latest)
    table.insert(t, i + 3, cost)
  end
  return latest
end

-- Gives back a reservation made by record(at, at + grace).
function ALGO.unrecord(r, t, at, grace, cost)
  local i, found = find(r, t, at + grace)
  if found then
    t[i + 1] = t[i + 1] - cost
    if t[i + 1] <= 0 then
      table.remove(t, i)
      table.remove(t, i)
    end
  end
end

-- When the last counted unit leaves the window (0 when nothing is counted).
function ALGO.clear_at(r, t)
  if #t == 0 then return 0 end
  return t[#t - 1] + r.period
end
