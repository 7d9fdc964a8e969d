-- Fixed window: at most `limit` units start in each aligned window
-- [k * period, (k + 1) * period). A burst across a boundary can reach 2 x limit in one
-- period's length: that is the algorithm's nature, kept for quotas where it is fine.
--
-- State of one rate, one hash field: a MessagePack stream of one or two arrays.
--   {k, units, k, units, ...}  the windows that hold units, sorted by window k: the
--                              current one and later ones holding reservations
--   {a, b}                     (only after a deep backlog) windows a..b count as full
-- A deep backlog must not make the state, or a check, grow with it. Reservations fill
-- windows first come, first served, so every window between now and the last few
-- reserved ones is already full for some rate of the key (or a later start would have
-- gone there). When more than MAX_AHEAD windows after the current one hold units, all but
-- the last KEEP_AHEAD of them, and whatever lies between, are folded into the range
-- a..b. For calls of one cost that changes no decision; a smaller call that could have
-- squeezed into a folded window's last units now queues behind the others (safe: a
-- range only ever counts more than was recorded). A give-back into it gives nothing back.
local ALGO = {}

-- MAX_AHEAD (windows after the current one that may hold units before the older ones are
-- folded) and KEEP_AHEAD (how many of the last of them stay as they are) are set before
-- the script from celery_throttle.core.state.StateLayout.

-- The fast path of window.lua, for one rate: an answer only where it is the general
-- path's own (load, usage, earliest at now, record, clear_at, dump), worked out in one
-- pass over the stored windows without building the rate's tables. `raw` must hold one
-- array (no folded range) of windows in strictly rising order, `cost` more units must
-- fit in every window [now, latest] touches, and (with `record`) no fold may be due.
-- Anything else returns nil and the general path decides. Returns the units used now
-- (before this call), when the last counted unit leaves its window (0: none), with
-- `record` the field's new value (else nil), and the larger of the units in the windows
-- of `now` and of `latest` (before this call: a lease's and publish's "at most half
-- full", which looks at those two windows, as window.lua's lease_fits does).
function ALGO.fit(raw, now, limit, period, cost, latest, record)
  local t = {}
  if raw then
    local ok, value, full = pcall(cmsgpack.unpack, raw)
    if not ok or type(value) ~= 'table' or full ~= nil or #value % 2 ~= 0 then return nil end
    t = value
  end
  local current, last = math.floor(now / period), math.floor(latest / period)
  -- out: what dump() writes; j: the next window the call touches not yet placed in it
  local out, used, ahead, j, prev, at_latest = {}, 0, 0, current, nil, 0
  for i = 1, #t, 2 do
    local k, u = t[i], t[i + 1]
    if type(k) ~= 'number' or type(u) ~= 'number' or (prev ~= nil and k <= prev) then return nil end
    prev = k
    if k >= current and u > 0 then  -- (what load() keeps)
      while record and j <= last and j < k do  -- touched windows holding nothing yet
        out[#out + 1] = j
        out[#out + 1] = cost
        j = j + 1
      end
      if k == current then used = u end
      if k == last then at_latest = u end
      if k >= j and k <= last and k == math.floor(k) then
        if u + cost > limit then return nil end
        if record then u = u + cost end
        j = k + 1
      end
      out[#out + 1] = k
      out[#out + 1] = u
    end
  end
  while record and j <= last do
    out[#out + 1] = j
    out[#out + 1] = cost
    j = j + 1
  end
  local n = #out
  local clear = n > 0 and (out[n - 1] + 1) * period or 0
  local peak = math.max(used, at_latest)
  if not record then return used, clear, nil, peak end
  for i = 1, n, 2 do
    if out[i] > current then ahead = ahead + 1 end
  end
  if ahead > MAX_AHEAD then return nil end  -- a fold is due
  return used, clear, cmsgpack.pack(out), peak
end

-- The general path's functions (window.lua's fast path needs only ALGO.fit above). They
-- are made when a call takes that path: in Lua 5.1 each function expression makes a
-- closure on every run of the script (sliding's took about 1.5 µs of a fitting check's
-- script time on Redis 7.0).
function ALGO.define()
  local function numbers(t)
    if type(t) ~= 'table' then return false end
    for i = 1, #t do
      if type(t[i]) ~= 'number' then return false end
    end
    return true
  end

  -- What can still count at `now`: the current window and later ones.
  function ALGO.load(r, raw, now)
    local ok, t, full = false, nil, nil
    if raw then ok, t, full = pcall(cmsgpack.unpack, raw) end
    -- A value that does not decode to a window state counts for nothing (and is replaced).
    if not ok or not numbers(t) or (full ~= nil and not (numbers(full) and #full == 2)) then
      t, full = {}, nil
    end
    local current = math.floor(now / r.period)
    r.current, r.units = current, {}
    for i = 1, #t - 1, 2 do
      if t[i] >= current and t[i + 1] > 0 then r.units[t[i]] = t[i + 1] end
    end
    if full and full[2] < current then
      full = nil
    elseif full and full[1] < current then
      full[1] = current
    end
    r.full = full
  end

  local function in_full(r, k)
    local full = r.full
    return full ~= nil and full[1] <= k and k <= full[2]
  end

  local function units_in(r, k)
    if in_full(r, k) then return r.limit end
    return r.units[k] or 0
  end

  -- Adds `units` (which may be negative) to window k; a window left with none is dropped.
  -- A folded window already counts as full, a passed one as nothing: nothing changes there.
  local function add(r, k, units)
    if in_full(r, k) or k < r.current then return end  -- (a window that has passed counts nothing)
    local u = (r.units[k] or 0) + units
    if u > 0 then r.units[k] = u else r.units[k] = nil end
  end

  function ALGO.usage(r, x)
    return units_in(r, math.floor(x / r.period))
  end

  -- Earliest time >= x at which `cost` more units fit. A start at t may happen up to
  -- `slack` later: it must fit in every window [t, t + slack] touches.
  function ALGO.earliest(r, x, cost, slack)
    local k = math.floor(x / r.period)
    while true do
      if in_full(r, k) then
        k = r.full[2] + 1
      else
        local at = math.max(x, k * r.period)
        local fits, j, last = true, k, math.floor((at + slack) / r.period)
        while fits and j <= last do
          fits = units_in(r, j) + cost <= r.limit
          j = j + 1
        end
        if fits then return at end
        k = k + 1
      end
    end
  end

  -- Records `cost` units starting in [at, latest], in each window that span touches (one
  -- or two, unless a slack is longer than a tiny window); returns the latest valid start.
  function ALGO.record(r, at, latest, cost)
    local k = math.floor(at / r.period)
    for j = k, math.floor(latest / r.period) do add(r, j, cost) end
    return (k + 1) * r.period - 1
  end

  function ALGO.unrecord(r, at, grace, cost)
    for j = math.floor(at / r.period), math.floor((at + grace) / r.period) do add(r, j, -cost) end
  end

  function ALGO.clear_at(r)
    local last = r.full and r.full[2] or nil
    for k in pairs(r.units) do
      if last == nil or k > last then last = k end
    end
    return last and (last + 1) * r.period or 0
  end

  -- Folds the windows ahead (see the top of this file); `ahead` is sorted.
  local function fold(r, ahead)
    local lo, hi = ahead[1], ahead[#ahead - KEEP_AHEAD + 1] - 1
    if r.full then lo, hi = math.min(lo, r.full[1]), math.max(hi, r.full[2]) end
    for _, k in ipairs(ahead) do
      if k <= hi then r.units[k] = nil end
    end
    r.full = {lo, hi}
  end

  -- The field's new value, or nil when nothing is left to count.
  function ALGO.dump(r)
    local keys, ahead = {}, {}
    for k in pairs(r.units) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do
      if k > r.current then ahead[#ahead + 1] = k end
    end
    if #ahead > MAX_AHEAD then fold(r, ahead) end
    local t = {}
    for _, k in ipairs(keys) do
      if r.units[k] then
        t[#t + 1] = k
        t[#t + 1] = r.units[k]
      end
    end
    if r.full then return cmsgpack.pack(t, r.full) end
    return #t > 0 and cmsgpack.pack(t) or nil
  end
end
