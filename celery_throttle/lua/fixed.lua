-- Fixed window: at most `limit` units start in each aligned window
-- [k * period, (k + 1) * period). A burst across a boundary can reach 2 x limit in one
-- period's length: that is the algorithm's nature, kept for quotas where it is fine.
--
-- State of one rate: a flat list {k, units, k, units, ...} sorted by window k, one pair
-- per window that holds units (the current one and any future window holding
-- reservations), stored MessagePack-encoded in one hash field.
local ALGO = {}

-- What can still count at `now`: the current window and later ones.
function ALGO.load(r, raw, now)
  local ok, t = false, nil
  if raw then ok, t = pcall(cmsgpack.unpack, raw) end
  -- A value that does not decode to a list of numbers counts for nothing (and is replaced).
  if not ok or type(t) ~= 'table' then t = {} end
  for i = 1, #t do
    if type(t[i]) ~= 'number' then t = {} break end
  end
  local current, n, first = math.floor(now / r.period), #t, 1
  while first < n and t[first] < current do first = first + 2 end
  if first > 1 then
    local out = {}
    for i = first, n do out[#out + 1] = t[i] end
    t = out
  end
  r.list = t
end

local function units_in(t, k)
  for i = 1, #t - 1, 2 do
    if t[i] == k then return t[i + 1] end
    if t[i] > k then break end
  end
  return 0
end

-- Adds `units` (which may be negative) to window k, keeping the list sorted and free
-- of empty windows.
local function add(t, k, units)
  local i = 1
  while i < #t and t[i] < k do i = i + 2 end
  if i < #t and t[i] == k then
    t[i + 1] = t[i + 1] + units
    if t[i + 1] <= 0 then
      table.remove(t, i)
      table.remove(t, i)
    end
  elseif units > 0 then
    table.insert(t, i, k)
    table.insert(t, i + 1, units)
  end
end

function ALGO.usage(r, x)
  local t = r.list
  return units_in(t, math.floor(x / r.period))
end

-- Earliest time >= x at which `cost` more units fit. A start at t may happen up to
-- `slack` later: when that crosses into the next window, it must fit in both.
function ALGO.earliest(r, x, cost, slack)
  local t = r.list
  local k = math.floor(x / r.period)
  while true do
    local at = math.max(x, k * r.period)
    local fits = units_in(t, k) + cost <= r.limit
    if fits and math.floor((at + slack) / r.period) > k then
      fits = units_in(t, k + 1) + cost <= r.limit
    end
    if fits then return at end
    k = k + 1
  end
end

-- Records `cost` units starting in [at, latest], in each window that span touches (at
-- most two: `latest - at` is a small slack or grace); returns the latest valid start.
function ALGO.record(r, at, latest, cost)
  local t = r.list
  local k, k2 = math.floor(at / r.period), math.floor(latest / r.period)
  add(t, k, cost)
  if k2 ~= k then add(t, k2, cost) end
  return (k + 1) * r.period - 1
end

function ALGO.unrecord(r, at, grace, cost)
  local t = r.list
  local k, k2 = math.floor(at / r.period), math.floor((at + grace) / r.period)
  add(t, k, -cost)
  if k2 ~= k then add(t, k2, -cost) end
end

function ALGO.clear_at(r)
  local t = r.list
  if #t == 0 then return 0 end
  return (t[#t - 1] + 1) * r.period
end

-- The field's new value, or nil when nothing is left to count.
function ALGO.dump(r)
  return #r.list > 0 and cmsgpack.pack(r.list) or nil
end
