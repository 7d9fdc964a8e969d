-- Sliding window: at most `limit` units start in ANY interval of `period` microseconds.
--
-- Each recorded entry is a span [start, latest]: the task starts somewhere in it. A new
-- entry starting at x is admitted only when every entry with latest > x - period, plus
-- its own cost, stays within the limit. That single check keeps the invariant for every
-- interval, whatever order entries were placed in, so reservations in the future obey it
-- too (see docs/design.md, "Windows").
--
-- To keep memory flat however large the limit, entries are merged into BUCKETS buckets per
-- period, keyed by floor(latest / width). A bucket keeps its total units and the greatest
-- `latest` of what it holds: merging only makes entries look later, which is safe.
--
-- The buckets, sorted by latest, are {latest, units} pairs. The last one is "hot": the
-- next starts mostly land in it. One hash field holds a MessagePack stream
--   cold units, hot latest, hot units, latest, units, latest, units, ...
-- (the cold pairs: every bucket before the hot one, and their total). A check that fits
-- and lands in the hot bucket, or opens a new one after it, reads three numbers and
-- writes them back in front of the unchanged cold bytes: it never decodes or encodes
-- the other buckets (with 100 full buckets, that took a check from 32 to 24 µs of
-- script time). Anything else (a denial looking for room, a start before the hot
-- bucket, a give-back) decodes them into a flat list {latest, units, ...} once and
-- works on that.
--
-- A deep backlog (reservations for thousands of tasks) must not make the state, or the
-- time of a check, grow with it. Every entry counts in usage(x) for every x before its
-- latest + period, so an entry followed by at least `limit` units can never decide
-- anything: wherever it counts, those later units already fill the window, and
-- earliest() always stops at a later entry. When a rate is written, such front buckets
-- are folded into the last of them ("the front": their units, its latest). What is left
-- behind the front holds fewer than `limit` units, plus one bucket: about one window of
-- buckets, whatever waits. Folding only makes units look later, so it is always safe; a
-- give-back of units folded away finds no bucket and gives nothing back.
-- (BUCKETS, and MAX_BUCKETS, the buckets kept at most per rate, are set before the script
-- from celery_throttle.core.state.StateLayout, which says why.)
-- A stored cold pair takes at least 10 bytes (a time in µs is a 9-byte integer), so a
-- state that is not decoded holds more than MAX_BUCKETS buckets only past this size.
local MAX_COLD_BYTES = 10 * (MAX_BUCKETS - 1)

local pack, unpack_one, unpack_limit = cmsgpack.pack, cmsgpack.unpack_one, cmsgpack.unpack_limit

local ALGO = {}

-- The fast path of window.lua, for one rate: an answer only where it is the general
-- path's own (load, usage, earliest at now, record, clear_at, dump), worked out on the
-- three numbers in front of the stream (and the cold buckets leaving the window) without
-- building the rate's tables. `raw` must be a stream (or nothing), `cost` more units must
-- fit now, and (with `record`) the start recorded in [now, latest] must land in the hot
-- bucket, open one after it, or land in or after the last cold one, with no fold due. Anything else returns nil
-- and the general path decides. Returns the units used now (before this call), when
-- the last counted unit leaves the window (0: none), with `record` the field's new value
-- (else nil), and the larger of the units used at `now` and at `latest` (before this
-- call: a lease's and publish's "at most half full"), which here is the first: a unit
-- counts until its bucket's latest + period, so what counts only falls as time goes on.
function ALGO.fit(raw, now, limit, period, cost, latest, record)
  local cut = now - period
  local cold_units, hot_latest, hot_units, cold_at = 0, nil, 0, -1
  if raw then
    local ok
    ok, cold_at, cold_units, hot_latest, hot_units = pcall(unpack_limit, raw, 3, 0)
    if not ok or type(cold_units) ~= 'number' or type(hot_latest) ~= 'number'
        or type(hot_units) ~= 'number' then return nil end
    if hot_latest <= cut then  -- the latest bucket left: all did
      cold_units, hot_latest, hot_units, cold_at = 0, nil, 0, -1
    else
      -- Buckets that left the window (a prefix of the cold ones: they are sorted by
      -- latest) are dropped, as read() drops them: on a busy key one leaves every
      -- 1/BUCKETS of a window, so most calls find one.
      while cold_at ~= -1 do
        local units_at, first, after, units
        ok, units_at, first = pcall(unpack_one, raw, cold_at)  -- (the next offset, then its latest)
        if not ok or type(first) ~= 'number' or units_at == -1 then return nil end
        if first > cut then break end
        ok, after, units = pcall(unpack_one, raw, units_at)
        if not ok or type(units) ~= 'number' then return nil end
        cold_units, cold_at = cold_units - units, after
      end
    end
  end
  local used = cold_units + hot_units
  if used + cost > limit then return nil end
  if not record then return used, hot_latest and hot_latest + period or 0, nil, used end
  local cold = cold_at == -1 and '' or string.sub(raw, cold_at + 1)
  local width = math.max(math.ceil(period / BUCKETS), 1000)  -- (as load() sets r.width)
  local b, hot = math.floor(latest / width), hot_latest and math.floor(hot_latest / width)
  if hot == nil then
    hot_latest, hot_units = latest, cost
  elseif b > hot then  -- the hot bucket turns cold
    cold = cold .. pack(hot_latest, hot_units)
    cold_units = cold_units + hot_units
    hot_latest, hot_units = latest, cost
  elseif b == hot then
    hot_units = hot_units + cost
    if latest > hot_latest then hot_latest = latest end
  else
    -- Before the hot bucket (a lease, or a start granted ahead, holds it later than now):
    -- into the last cold bucket if it is this one's, else a new bucket after it, where
    -- record() places it in the flat list. Before the last cold bucket, or with a fold
    -- possibly due (fold() runs on every flat list), the general path does it.
    local got = {pcall(unpack_limit, cold, 2 * MAX_BUCKETS, 0)}  -- ok, next offset, values
    local n = #got - 2
    if not got[1] or got[2] ~= -1 or n % 2 ~= 0 or n / 2 + 2 > MAX_BUCKETS
        or cold_units + hot_units + cost >= limit then return nil end
    if n == 0 then
      cold = pack(latest, cost)
    else
      local last_latest, last_units = got[n + 1], got[n + 2]
      if type(last_latest) ~= 'number' or type(last_units) ~= 'number' then return nil end
      local last = math.floor(last_latest / width)
      if last == b then
        local tail = pack(last_latest, last_units)
        if string.sub(cold, -#tail) ~= tail then return nil end
        cold = string.sub(cold, 1, #cold - #tail) .. pack(math.max(last_latest, latest), last_units + cost)
      elseif last < b then
        cold = cold .. pack(latest, cost)
      else
        return nil
      end
    end
    cold_units = cold_units + cost
  end
  if cold_units + hot_units > limit or #cold > MAX_COLD_BYTES then return nil end  -- a fold may be due
  return used, hot_latest + period, pack(cold_units, hot_latest, hot_units) .. cold, used
end

-- The general path's functions (window.lua's fast path needs only ALGO.fit above). They
-- are made when a call takes that path: in Lua 5.1 each function expression makes a
-- closure on every run of the script (sliding's took about 1.5 µs of a fitting check's
-- script time on Redis 7.0).
function ALGO.define()
  local function number(v)
    if type(v) ~= 'number' then error('not a window state') end
    return v
  end

  local function empty(r)
    r.list, r.cold, r.cold_units, r.cold_first, r.hot_latest, r.hot_units = nil, '', 0, nil, nil, 0
  end

  -- Reads the stream (anything else is not a window state: read() fails, and the field
  -- starts afresh).
  local function decode(r, raw)
    local at, first = unpack_one(raw, 0)
    r.cold_units = number(first)
    at, r.hot_latest = unpack_one(raw, at)
    at, r.hot_units = unpack_one(raw, at)
    number(r.hot_latest)
    number(r.hot_units)
    if at ~= -1 then
      r.cold = string.sub(raw, at + 1)
      r.cold_first = number(select(2, unpack_one(r.cold, 0)))
    end
  end

  -- Decodes `raw` and drops what no longer counts at `now`: entries with latest <=
  -- now - period (always a prefix).
  local function read(r, raw, now)
    decode(r, raw)
    local cut = now - r.period
    local t = r.list
    if t then
      local n, first = #t, 1
      while first < n and t[first] <= cut do first = first + 2 end
      if first > 1 then
        local out = {}
        for i = first, n do out[#out + 1] = t[i] end
        r.list = out
      end
      return
    end
    if r.hot_latest <= cut then return empty(r) end  -- the latest bucket left: all did
    local at = 0
    while r.cold_first ~= nil and r.cold_first <= cut do
      local units
      at, units = unpack_one(r.cold, (unpack_one(r.cold, at)))  -- skip its latest
      r.cold_units = r.cold_units - number(units)
      r.cold_first = at ~= -1 and number(select(2, unpack_one(r.cold, at))) or nil
    end
    if at ~= 0 then r.cold = r.cold_first and string.sub(r.cold, at + 1) or '' end
  end

  function ALGO.load(r, raw, now)
    r.width = math.max(math.ceil(r.period / BUCKETS), 1000)
    empty(r)
    -- A value that does not decode to a window state counts for nothing (and is replaced).
    if raw and not pcall(read, r, raw, now) then empty(r) end
  end

  -- The buckets as one flat list, from here on the only copy of them.
  local function flat(r)
    if r.list then return r.list end
    local t, at = {}, 0
    while r.cold ~= '' and at ~= -1 do
      local chunk = {unpack_limit(r.cold, 1000, at)}
      at = chunk[1]
      for i = 2, #chunk do t[#t + 1] = chunk[i] end
    end
    if r.hot_latest then
      t[#t + 1] = r.hot_latest
      t[#t + 1] = r.hot_units
    end
    r.list = t
    return t
  end

  function ALGO.usage(r, x)
    local cut = x - r.period
    if not r.list then
      if r.hot_latest == nil or r.hot_latest <= cut then return 0 end
      if r.cold_first == nil or r.cold_first > cut then return r.cold_units + r.hot_units end
    end
    local t, used = flat(r), 0
    for i = #t - 1, 1, -2 do
      if t[i] <= cut then break end
      used = used + t[i + 1]
    end
    return used
  end

  -- Earliest time >= x at which `cost` more units fit. Counts only fall as x grows.
  function ALGO.earliest(r, x, cost, slack)
    local used = ALGO.usage(r, x)
    if used + cost <= r.limit then return x end
    local t, cut = flat(r), x - r.period
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
    local b = math.floor(latest / r.width)
    local i = #t - 1
    while i >= 1 and math.floor(t[i] / r.width) > b do i = i - 2 end
    return i, i >= 1 and math.floor(t[i] / r.width) == b
  end

  -- Records `cost` units that start in [at, latest]; returns the latest valid start.
  function ALGO.record(r, at, latest, cost)
    if not r.list then
      local hot = r.hot_latest and math.floor(r.hot_latest / r.width)
      local b = math.floor(latest / r.width)
      if hot == nil or b > hot then
        if hot ~= nil then  -- the hot bucket turns cold
          r.cold = r.cold .. pack(r.hot_latest, r.hot_units)
          r.cold_units = r.cold_units + r.hot_units
          r.cold_first = r.cold_first or r.hot_latest
        end
        r.hot_latest, r.hot_units = latest, cost
        return latest
      elseif b == hot then
        r.hot_units = r.hot_units + cost
        if latest > r.hot_latest then r.hot_latest = latest end
        return latest
      end
    end
    local t = flat(r)
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
  function ALGO.unrecord(r, at, grace, cost)
    local t = flat(r)
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
  function ALGO.clear_at(r)
    if r.list then
      local n = #r.list
      return n == 0 and 0 or r.list[n - 1] + r.period
    end
    return r.hot_latest and r.hot_latest + r.period or 0
  end

  -- Folds the front (see the top of this file) of a decoded list: the first bucket is
  -- merged into the next one while that one, too, is followed by at least `limit` units.
  -- (Merging into a bucket that could still decide something would make the merged units
  -- count until that bucket leaves the window: after a give-back, a late task would find
  -- the units of a window long gone still in its way.)
  local function fold(r)
    local t = r.list
    local n = #t
    local after = 0  -- units after the second bucket
    for i = 6, n, 2 do after = after + t[i] end
    local first, units, buckets = 1, t[2], n / 2
    while first + 2 < n and (after >= r.limit or buckets > MAX_BUCKETS) do
      first = first + 2
      units = units + t[first + 1]
      if first + 2 < n then after = after - t[first + 3] end
      buckets = buckets - 1
    end
    if first > 1 then
      local out = {t[first], units}
      for i = first + 2, n do out[#out + 1] = t[i] end
      r.list = out
    end
  end

  -- The field's new value, or nil when nothing is left to count.
  function ALGO.dump(r)
    -- Only more than `limit` units, or more buckets than a window holds, can need a fold.
    if not r.list and (r.cold_units + r.hot_units > r.limit or #r.cold > MAX_COLD_BYTES) then flat(r) end
    if not r.list then
      return r.hot_latest and pack(r.cold_units, r.hot_latest, r.hot_units) .. r.cold or nil
    end
    if #r.list > 2 then fold(r) end
    local t = r.list
    local n = #t
    if n == 0 then return nil end
    local cold_units = 0
    for i = 2, n - 2, 2 do cold_units = cold_units + t[i] end
    local parts = {pack(cold_units, t[n - 1], t[n])}
    -- (in chunks: unpack() of a long list would overflow Lua's C stack)
    for i = 1, n - 2, 1000 do parts[#parts + 1] = pack(unpack(t, i, math.min(i + 999, n - 2))) end
    return table.concat(parts)
  end
end
