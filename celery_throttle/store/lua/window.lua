-- One (scope, key): its windows, and the line of tasks waiting for room in them. Every
-- operation on a key is one run of one script, so that counting a start, joining the
-- line and releasing its head are each atomic.
--
-- Each operation is a script of its own, put together at load time (store/window.py,
-- window_script): the includes these files name (lua/include/: the clock, the adaptive
-- law), the algorithm (sliding.lua or fixed.lua, which defines ALGO), this file (the
-- windows: what every operation shares), line.lua (the line's helpers) and the
-- operation's own file (lua/op/), keeping only the functions the operation reaches. The
-- loader writes each constant's value where its name is (the timing policy, ScriptPolicy
-- in core/timing.py, which says what each is and why; the state layout,
-- state.StateLayout; the reply codes and fields; the state format): a constant is no
-- upvalue to capture. An error's line is told as its file's own (store/scripts.py,
-- true_lines). tests/reference.py and tests/line_reference.py are the twins, function by
-- function.
--
-- KEYS[1]  hash: the state of every rate of this (scope, key), one field per rate (named
--          by the caller), and 'e' (epoch), 'd' and 'v' (the learnt dispatch delay and its
--          deviation), 'f' (format), 'A' (an adaptive throttle's last pushback)
-- KEYS[2]  hash: the line's own counts (line.lua says which)
-- KEYS[3]  sorted set: the line, entry -> its place (FIFO)
-- KEYS[4]  hash: entry -> its message, and entry .. '#' -> what it is (line.lua)
-- KEYS[5]  sorted set: entries released and not started yet, entry -> when its time is up
-- KEYS[6]  sorted set: concurrency slots, holder -> when its lease ends
-- KEYS[7]  sorted set: entries that started lately, entry -> when
-- KEYS[8]  (a shared concurrency limit, or a single Redis) string: the key's cap, the
--          slots it may hold of its scope's K (waits/sharer.py writes it; none: 0)
-- (All share the hash tag of KEYS[1]: one Redis Cluster slot.)
-- KEYS[9..11]  (a single Redis only) the index of lines (index.lua's KEYS) and the list
--          the releasers wait on: the call tells the index of its key itself (line.lua's
--          tell_index). On a Redis Cluster they are in other slots: the caller tells it.
--
-- ARGV[1]  now in microseconds, or '' to read the Redis server clock (tests only)
-- ARGV[2]  op (its script's name: lua/op/ has them)
-- ARGV[3]  cost: units this call uses of every rate (a number), or one count per rate,
--          comma-separated ('1,500'), when its rates count different units; for 'settle',
--          the units to add to where it was counted (negative: a refund)
-- ARGV[4]  slack (µs): how long after the check the body may start (a start counts as
--          anywhere in [now, now + slack])
-- ARGV[5]  not before (µs, Redis clock; 0: none): the scope or key is paused until then
-- ARGV[6]  concurrency: at most this many hold a slot at once (0: no such limit); -K: the
--          scope's K, shared between its keys: this key holds its cap (KEYS[8]) at most
-- ARGV[7]  a running body's slot lease (µs): a holder that does not renew it loses it
-- ARGV[8]  lead (µs) while nothing is learnt: how long before its start a task is released
-- ARGV[9]  controls read at (µs, Redis clock; 0: unknown): when the process read the
--          pause, limits and K above (a due time computed under controls read before the
--          key's last wake-up may bring its look earlier, never later: index.lua)
-- ARGV[10] number of rates, then ARGV[11..]: limit, period (µs) and field name per rate
--          (a field named 'name.unit' counts that unit). An adaptive throttle's count is
--          followed by its law, '2;floor,decrease,growth' (core/adapt.py): each limit is
--          then in force at the share of it field 'A' of KEYS[1] says (adapt.lua writes it)
-- ARGV[11 + 3 * rates ..]  the operation's own (lua/op/)
--
-- Replies (times in µs of the Redis clock): protocol.WindowReply's fields, each at its
--   place (built by name: reply() below), then id, payload, kind per task released or
--   reported
local key = KEYS[1]
-- include: clock, cubic
local now = clock_now(ARGV[1])
local op = ARGV[2]
local slack, not_before = tonumber(ARGV[4]), tonumber(ARGV[5])
local concurrency, slot_lease, lead_default = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
-- The slots this key may hold: its K, or its cap in its scope's share of K (the sharer moves
-- it; a key it has not seen yet holds none, and its tasks wait in its line until it has).
local slot_cap = concurrency
if concurrency < 0 then
  concurrency = -concurrency
  slot_cap = math.max(math.min(concurrency, tonumber(redis.call('GET', KEYS[8]) or '0') or 0), 0)
end
if not_before <= now then not_before = 0 end  -- a pause that is over changes nothing
local controls_read = tonumber(ARGV[9]) or 0
local n_rates, adapt_law = string.match(ARGV[10], '^(%d+);?(.*)$')
local fields = {'e', 'd', 'v', 'f'}
n_rates = tonumber(n_rates)
-- The operation's own arguments start here.
local P = 11 + 3 * n_rates
-- The cost: `cost` of every rate, or (rates of different units) `costs[i]` of rate i.
local cost, costs = tonumber(ARGV[3]), nil
if cost == nil then
  costs = {}
  for c in string.gmatch(ARGV[3], '%-?%d+') do costs[#costs + 1] = tonumber(c) end
  if #costs ~= n_rates then return redis.error_reply('window.lua: ' .. n_rates .. ' rates, costs ' .. ARGV[3]) end
end

for i = 1, n_rates do fields[4 + i] = ARGV[10 + 3 * i] end
if adapt_law ~= '' then fields[5 + n_rates] = 'A' end
local stored = redis.call('HMGET', key, unpack(fields))
if stored[1] and stored[4] and tonumber(stored[4]) ~= STATE_FORMAT then
  -- Written in another format (a later version's, and the deploy rolled back): not read
  -- as this one, but started afresh, as a hash that expired would be.
  redis.call('DEL', key)
  for i = 1, #fields do stored[i] = false end
end
-- HMGET answers false for a missing field.
local epoch = stored[1] or nil

-- Each rate's limit in force: the caller's, or an adaptive throttle's at the share of it
-- its last pushback leaves now (core/adapt.py's level and scaled_limit, the same sums:
-- tests/script/test_adapt_script.py holds the two to each other), at least the call's own units.
local limits = {}
for i = 1, n_rates do limits[i] = tonumber(ARGV[8 + 3 * i]) end
if adapt_law ~= '' and stored[5 + n_rates] then
  local floor_, decrease, growth = cubic_law(adapt_law)
  local w_max, at = cubic_pushback(stored[5 + n_rates])
  if floor_ and w_max then
    local window = nil
    for i = 1, n_rates do
      local p = tonumber(ARGV[9 + 3 * i])
      if window == nil or p < window then window = p end
    end
    local level = cubic_level(w_max, math.max(now - at, 0) / math.max(window, 1), floor_, decrease, growth)
    for i = 1, n_rates do
      local least = costs and costs[i] or cost
      limits[i] = math.min(limits[i], math.max(least, math.floor(limits[i] * level)))
    end
  end
end
local delay = stored[2] and tonumber(stored[2]) or nil
local jitter = stored[3] and tonumber(stored[3]) or nil

-- How early a task is released before the start it may take: the learnt dispatch delay
-- and a margin of LEAD_JITTERS deviations (at most half the busiest rate's spacing),
-- else the caller's default.
local function lead(half_pace)
  if delay == nil then return lead_default end
  return delay + math.min(LEAD_JITTERS * jitter, half_pace)
end

-- Keep the hash as long as something in it still counts. When the TTL must grow, grow
-- it by a further shortest window, so a busy key is not re-expired on every call.
local function keep_until(clear, shortest)
  if clear > now then
    local ttl = math.ceil((clear - now) / 1000) + STATE_TTL_PAD_MS
    if redis.call('PTTL', key) < ttl then
      redis.call('PEXPIRE', key, ttl + math.ceil(shortest / 1000))
    end
  end
end

-- A reply: the fields of `f` by name, each at its place (REPLY_<FIELD>: protocol.WindowReply's
-- fields in their order, written in by the loader), then the tasks of `reported` ({id,
-- payload, kind} each, flat). A field not given is 0 ('' for rooms), but `now`, the epoch
-- (unless given) and the key's slot cap, which every reply tells as they are.
local function reply(f, reported)
  local out = {0, 0, 0, 0, 0, 0, 0, 0, '', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
  out[REPLY_CODE], out[REPLY_WAIT_US], out[REPLY_REMAINING] = f.code, f.wait_us or 0, f.remaining or 0
  out[REPLY_CLEAR_AT_US], out[REPLY_NOW_US], out[REPLY_EPOCH] = f.clear_at_us or 0, now, f.epoch or tonumber(epoch or '0')
  out[REPLY_LEAD_US], out[REPLY_LEASED], out[REPLY_ROOMS] = f.lead_us or 0, f.leased or 0, f.rooms or ''
  out[REPLY_START_US], out[REPLY_LATEST_US], out[REPLY_WAITING] = f.start_us or 0, f.latest_us or 0, f.waiting or 0
  out[REPLY_OUT], out[REPLY_RUNNING], out[REPLY_DUE_US] = f.out or 0, f.running or 0, f.due_us or 0
  out[REPLY_TELL_INDEX], out[REPLY_WAITED_US], out[REPLY_HELD] = f.tell_index or 0, f.waited_us or 0, f.held or 0
  out[REPLY_SLOT_CAP] = slot_cap
  for _, v in ipairs(reported or {}) do out[#out + 1] = v end
  return out
end

-- The fast path: a fresh 'acquire' (with a lease or without), a 'screen', or an 'admit'
-- sent without its message, of a key that nothing waits for, nothing is out of and no
-- slot is held of, out of any pause and concurrency limit, that fits now (an 'admit': with
-- every rate staying at most half full, the only answer it takes). Far under the limit
-- that is nearly every call, and the general path's tables and closures cost it about three
-- times the script time (Lua 5.1 makes a closure of every function expression on every
-- call): an 'admit' took 156 µs there against 48 here, a leased 'acquire' 237 against 68.
-- Each ALGO.fit answers only where its answer is the general path's own, so the reply
-- and the state written are the same (tests/script/test_line_model.py holds both to one model):
-- anything it does not take (a denial, a lease or an 'admit' past half full, a bucket
-- leaving the window, a fold due, an entry the key knows, ...) goes on to the general
-- path, nothing written.
local fast_entry = (op == 'acquire' or op == 'screen') and P + 3 or (op == 'admit' and P or nil)
if fast_entry and n_rates > 0 and not_before == 0 and concurrency == 0
    and (op ~= 'admit' or ARGV[P + 1] == '')
    and redis.call('EXISTS', KEYS[2], KEYS[4], KEYS[5], KEYS[6]) == 0
    and (ARGV[fast_entry] == '' or not redis.call('ZSCORE', KEYS[7], ARGV[fast_entry])) then
  local record, publish = op == 'acquire', op == 'admit'
  -- One pass over the rates: the call, or (`n` > 0) a lease of `n`, started anywhere in
  -- [now, latest]. nil: the general path decides; false: a lease or an 'admit' would go
  -- past half full; else what the reply and the write need.
  local function pass(n, latest)
    local p = {clear = 0, rooms = {}, sets = {}}
    for i = 1, n_rates do
      local limit, period = limits[i], tonumber(ARGV[9 + 3 * i])
      local c = costs and costs[i] or cost
      local u = n > 0 and (costs and n * c or n) or c
      if u > limit then return n > 0 and false or nil end  -- (the call alone: TOO_COSTLY)
      local used, clear_at, value, peak = ALGO.fit(stored[4 + i] or nil, now, limit, period, u, latest, record)
      if used == nil then return nil end
      if (n > 0 or publish) and 2 * (peak + u) > limit then return false end
      local f = limit - used - (record and u or 0)
      if p.free == nil or f < p.free then p.free = f end
      if clear_at > p.clear then p.clear = clear_at end
      if p.shortest == nil or period < p.shortest then p.shortest = period end
      local pace = math.floor(period / limit / 2)
      if p.half_pace == nil or pace < p.half_pace then p.half_pace = pace end
      if publish then
        p.rooms[i] = math.floor(limit / 2) - peak
        if p.room == nil or p.rooms[i] < p.room then p.room = p.rooms[i] end
      end
      if record then
        p.sets[#p.sets + 1] = fields[4 + i]
        p.sets[#p.sets + 1] = value
      end
    end
    return p
  end
  -- A lease asked (line.lua's fresh: units of every rate, or calls like this one), taken
  -- only while every rate stays at most half full; else the call alone.
  local lease = record and tonumber(ARGV[P]) or 0
  if lease <= (costs and 1 or cost) then lease = 0 end
  local got = pass(lease, now + (lease > 0 and math.max(tonumber(ARGV[P + 1]), slack) or slack))
  if got == false and lease > 0 then
    lease = 0
    got = pass(0, now + slack)
  end
  if got then
    if record then
      local sets = got.sets
      if epoch == nil then
        epoch = string.format('%.0f', now)
        sets[#sets + 1] = 'e'
        sets[#sets + 1] = epoch
        sets[#sets + 1] = 'f'
        sets[#sets + 1] = STATE_FORMAT
      end
      redis.call('HSET', key, unpack(sets))
      keep_until(got.clear, got.shortest)
    end
    local f = {code = RUN, remaining = math.max(got.free, 0), clear_at_us = got.clear, lead_us = lead(got.half_pace),
               leased = lease}
    if publish then f.leased, f.rooms = got.room, costs and table.concat(got.rooms, ',') or '' end
    return reply(f)
  end
end

ALGO.define()  -- (the algorithm's general functions: see its ALGO.define)
local rates = {}
local shortest, half_pace = nil, nil
for i = 1, n_rates do
  local field = fields[4 + i]
  local r = {limit = limits[i], period = tonumber(ARGV[9 + 3 * i]), field = field,
             unit = string.match(field, '%.([%a_][%w_]*)$') or '', cost = costs and costs[i] or cost,
             dirty = false}
  if shortest == nil or r.period < shortest then shortest = r.period end
  local pace = math.floor(r.period / r.limit / 2)
  if half_pace == nil or pace < half_pace then half_pace = pace end
  rates[i] = r
end
for i, r in ipairs(rates) do ALGO.load(r, stored[4 + i] or nil, now) end
-- (No rates: a concurrency limit alone. Nothing below waits on a window then.)
shortest, half_pace = shortest or 1000000, half_pace or 0

-- -- what every operation shares ------------------------------------------------------

local function remaining(x)
  local free = nil
  for _, r in ipairs(rates) do
    local f = r.limit - ALGO.usage(r, x)
    if free == nil or f < free then free = f end
  end
  return math.max(free or 0, 0)
end

local function clear_at()
  local t = 0
  for _, r in ipairs(rates) do t = math.max(t, ALGO.clear_at(r)) end
  return t
end

-- The dispatch delay and its deviation a claim learnt ({delay, jitter} as written), for
-- write_back to write with the windows: one HSET and one look at the TTL, not two each.
local learnt = nil

-- A hash of no window (a concurrency limit alone) keeps what it learnt for a while too.
local function keep_learnt()
  if redis.call('PTTL', key) == -1 then
    redis.call('PEXPIRE', key, math.ceil(shortest / 1000) + STATE_TTL_PAD_MS)
  end
end

local function write_back()
  local dels, sets = {}, {}
  for _, r in ipairs(rates) do
    local value = r.dirty and ALGO.dump(r)
    if value then
      sets[#sets + 1] = r.field
      sets[#sets + 1] = value
    elseif r.dirty then
      dels[#dels + 1] = r.field
    end
    r.dirty = false
  end
  if #dels > 0 then redis.call('HDEL', key, unpack(dels)) end
  local learning = learnt
  learnt = nil
  if #sets == 0 then
    if learning then
      redis.call('HSET', key, 'd', learning[1], 'v', learning[2])
      keep_learnt()
    end
    return
  end
  if learning then
    sets[#sets + 1], sets[#sets + 2], sets[#sets + 3], sets[#sets + 4] = 'd', learning[1], 'v', learning[2]
  end
  if epoch == nil then
    epoch = string.format('%.0f', now)
    sets[#sets + 1] = 'e'
    sets[#sets + 1] = epoch
    sets[#sets + 1] = 'f'
    sets[#sets + 1] = STATE_FORMAT
  end
  redis.call('HSET', key, unpack(sets))
  local clear = clear_at()
  keep_until(clear, shortest)
  if learning and clear <= now then keep_learnt() end
end

-- A count of every rate (a number) or one per rate ('3,-500', as ARGV[3]): rate i's is
-- the result's [i].
local function per_rate(text)
  local out, one = {}, tonumber(text)
  for v in string.gmatch(text, '%-?%d+') do out[#out + 1] = tonumber(v) end
  if one then for i = 1, n_rates do out[i] = one end end
  if #out ~= n_rates then error('window.lua: ' .. n_rates .. ' rates, counts ' .. text) end
  return out
end

-- Record a start of `units` (rate i's is units[i]) anywhere in [at, latest].
local function record(at, latest, units)
  for i, r in ipairs(rates) do
    ALGO.record(r, at, latest, units[i])
    r.dirty = true
  end
end

-- Give back a start recorded by record(at, at + span, units).
local function unrecord(at, span, units)
  for i, r in ipairs(rates) do
    ALGO.unrecord(r, at, span, units[i])
    r.dirty = true
  end
end

-- The units of rate `r` a lease of `n` takes: n of every rate (a call of one cost), or n
-- calls like this one (a cost per rate).
local function lease_units(r, n)
  return costs and n * r.cost or n
end

-- Whether a lease of `n` (nil: this call alone) started anywhere in [now, now + span]
-- fits, leaving every rate at most half full.
local function lease_fits(n, span)
  for _, r in ipairs(rates) do
    local u = n and lease_units(r, n) or r.cost
    local used = math.max(ALGO.usage(r, now), ALGO.usage(r, now + span))
    if 2 * (used + u) > r.limit then return false end
    -- (only now: earliest() looks for room however far ahead, and `u` fit a window)
    if ALGO.earliest(r, now, u, span) ~= now then return false end
  end
  return true
end

-- The earliest start, from `from` on, at which every rate admits `units[i]` more units
-- beside `beside[i]` (units of tasks released and not started yet, which will start
-- anywhere from now on): each earliest() only moves it forward; nil when they never fit
-- (not until some of what is beside starts) or the rates still disagree after
-- SETTLE_ROUNDS passes.
local function earliest(from, units, beside)
  local x = from
  for _ = 1, SETTLE_ROUNDS do
    local settled = true
    for i, r in ipairs(rates) do
      local need = units[i] + (beside and beside[i] or 0)
      if need > r.limit then return nil end
      local e = ALGO.earliest(r, x, need, slack)
      if e > x then x, settled = e, false end
    end
    if settled then return x end
  end
  return nil
end

-- When `units` queued behind `ahead[i]` units (the line before it, and what is out) could
-- start, roughly: whole windows for all but the last part, the last where it fits. An
-- estimate (the line's `max_wait` and `throttle why`), not a promise.
local function estimate(from, units, ahead)
  local t = from
  for i, r in ipairs(rates) do
    local total = units[i] + ahead[i]
    local windows = math.floor((total - 1) / r.limit)
    local e = ALGO.earliest(r, from, total - windows * r.limit, slack) + windows * r.period
    if e > t then t = e end
  end
  return t
end

-- The call's own cost, per rate.
local call_units = {}
for i, r in ipairs(rates) do call_units[i] = r.cost end
