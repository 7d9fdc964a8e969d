-- Checks and records one call against every rate of one (scope, key), atomically.
-- Prepended at load time by the algorithm (sliding.lua or fixed.lua), which defines ALGO,
-- and before it by the constants both read: the timing policy (SETTLE_ROUNDS,
-- STATE_TTL_PAD_MS, ...: celery_throttle/timing.py, ScriptPolicy, says what each is and
-- why), the state layout (SLOTS, ...: protocol.py, StateLayout), the reply codes and the
-- state format. (An error's line is told as this file's own: store.py, true_lines.)
--
-- Each operation (ARGV[2]) is a function of its own, at the end: acquire, screen,
-- reserve_start, admit, claim, settle, peek, dispatched after the one check of the cost. They
-- share `check`, the decision from the earliest start on (run now, reserve, or deny).
-- Before them, a fast path answers an acquire or screen that fits now without building
-- the general path's tables. tests/reference.py is the twin, function by function.
--
-- KEYS[1]  hash holding the state of every rate of this (scope, key): one field per rate
--          (named by the caller), plus 'e', 'd', 'v' and 'f' below
-- KEYS[2]  for 'claim': a marker naming this task's reservation (same hash tag). A
--          reservation is used once: a second claim of it (a duplicated or redelivered
--          message) is checked afresh instead of running on, or giving back, units that
--          were already used.
--          For 'admit' and 'reserve' (at publish): a counter (same hash tag) of the tasks
--          held back there, by the window or a pause (kept HELD_COUNT_TTL_MS after the last).
-- ARGV[1]  now in microseconds, or '' to read the Redis server clock (tests only)
-- ARGV[2]  op: 'acquire' | 'peek' | 'claim' | 'screen' | 'reserve' | 'admit' | 'settle' ('screen':
--          like 'acquire', but a call that fits now is not recorded: the worker's pool
--          will acquire it; 'reserve', at publish: a start is reserved even for a call
--          that fits, no sooner than the key's learnt dispatch delay from now, and the
--          worker claims it when the task arrives; 'admit', at publish: a call that fits
--          now leaving every rate at most half full is not recorded (RUN, and `leased`
--          says how many units calls of this key may take before a rate is half full),
--          any other is a 'reserve'; 'settle': a call that started reports what it
--          really cost, and the window counts that instead of the estimate)
-- ARGV[3]  '1' to reserve a future start when denied, '0' not to
-- ARGV[4]  cost: units this call uses, of every rate (a number), or one count per rate in
--          their order, comma-separated ('1,500'), when its rates count different units
--          (requests and tokens): each rate then counts its own. Such a call's lease
--          (ARGV[14]) is of calls like it, and an 'admit' that fits answers the room of
--          each rate (the reply's `rooms`)
-- ARGV[5]  grace (µs): the least a reserved start may come late and still count as on
--          time (it grows with the dispatch jitter learnt below, that growth up to
--          1/LEARNT_CAP_PARTS of the shortest window)
-- ARGV[6]  slack (µs): how long after the check the body may start (a call admitted now
--          counts as starting within it; a claim must leave it before its latest start)
-- ARGV[7..12] for 'claim': the reservation's start, latest start, cost (as ARGV[4]),
--          grace, epoch, and lead (how early it was sent back); for 'settle': the span a
--          started call was counted in (ARGV[7], ARGV[8]), the units to add to it
--          (ARGV[9], as ARGV[4]: its reported cost less what was counted; negative, a
--          refund) and the epoch it was counted in (ARGV[11])
-- ARGV[13] '1' if this claim is the task's arrival (learn its delay from it), '0' if not,
--          '2' for an arrival whose start was reserved behind a pause that has since been
--          lifted (resumed, or shortened): its units are given back and the call checked
--          afresh, even before that start (and its trip is not learnt)
-- ARGV[14] lease: units of every rate an 'acquire' that fits may take at once for calls to
--          come (0: none); with a cost per rate, calls like this one (each rate then
--          takes that many times its own count; 1 or 0: none)
-- ARGV[15] lease span (µs): those calls start within it
-- ARGV[16] max wait (µs): a start further away than this is not reserved (0: no cap)
-- ARGV[17] not before (µs, Redis clock; 0: none): the scope or key is paused until then.
--          Nothing starts before it: a call is reserved a start after it, and a claim
--          whose reserved start falls before it gives its units back and is reserved again
-- ARGV[18] pause horizon (µs): a pause ending further away reserves nothing (a resume
--          must be able to let its tasks go): the reply is a denial without a start,
--          whose wait is this horizon (check again then)
-- ARGV[19] early (µs), for 'claim': a claim that comes at most this long before its
--          reserved start is granted at once (RUN_AT: it starts at that start, after the
--          caller's wait, with no second call); further ahead, EARLY (0: never granted)
-- ARGV[20] number of rates, then ARGV[21..]: limit, period (µs) and field name per rate
--
-- A lease is granted only while every rate stays at most half full with it: the leased
-- units are recorded as one span [now, now + lease span], so every start made with them
-- is counted exactly like an admitted one, and a key near its limit is checked call by
-- call. Units a worker leases and does not use count until they leave the window.
--
-- The hash's field 'f' is its format (STATE_FORMAT, celery_throttle.protocol; absent:
-- written before the field, format 1), set with 'e' when the hash is created; a hash of
-- another format is started afresh. The field 'e' is its epoch: set when the hash is created. A reservation made
-- in another epoch (the hash was reset, expired, or Redis lost its data) is not honoured:
-- its units are no longer counted, so the call is checked afresh.
--
-- Fields 'd' and 'v' learn how long a reserved task takes to come back, the way TCP
-- learns a round trip: d is the smoothed delay from "due to arrive" to its claim, v its
-- mean deviation. Denied tasks are sent back d early plus a margin of LEAD_JITTERS v (at
-- most half the spacing of the busiest rate, since each early task waits in a pool
-- process), so most arrive before their start and wait for it in the worker. A
-- reservation's grace covers GRACE_JITTERS v: busy workers widen it (a little throughput
-- for far fewer voided reservations), idle ones keep it tight.
--
-- Returns {code, wait, remaining, clear_at, start, latest, now, epoch, lead, grace, leased}
-- and, for an 'admit' of a call with a cost per rate that fits, `rooms` (times in µs):
--   code  (constants set before the script from celery_throttle.protocol.Code)
--          RUN run now
--          DENIED not now, and no start reserved
--          RESERVED not now, and a start was reserved: start, latest, grace
--          EARLY a claim that came before its reserved start
--          RUN_AT a claim that came at most ARGV[19] before its reserved start: it is the
--            caller's, to start when `wait` has passed (used: a second claim of it is
--            checked afresh)
--          TOO_FAR denied, and the earliest start (in `wait`) is further than the max
--            wait (a pause's own length not counted): nothing reserved
--          TOO_COSTLY the cost exceeds the limit of one of the rates (nothing else set)
--   wait  µs until the call may start
--   remaining  units still free now, over the tightest rate
--   clear_at  when every counted unit has left its window
--   lead  d plus the margin above (-1 while nothing is learnt): send reserved tasks that early
--   grace  the grace given to the start reserved by this call (0 if none)
--   leased  units granted as a lease (with a cost per rate: calls), this call's own
--          included (0 if none); for an
--          'admit' that fits: the units the key may take before a rate is half full
--   rooms  (a cost per rate) the units each rate may take before it is half full
local key = KEYS[1]
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local op, reserve = ARGV[2], ARGV[3] == '1'
local grace, slack = tonumber(ARGV[5]), tonumber(ARGV[6])
local lease, lease_span, max_wait = tonumber(ARGV[14]), tonumber(ARGV[15]), tonumber(ARGV[16])
local not_before, pause_horizon = tonumber(ARGV[17]), tonumber(ARGV[18])
if not_before <= now then not_before = 0 end  -- a pause that is over changes nothing
local n_rates, fields = tonumber(ARGV[20]), {'e', 'd', 'v', 'f'}
-- The cost: `cost` of every rate, or (rates of different units) `costs[i]` of rate i.
local cost, costs = tonumber(ARGV[4]), nil
if cost == nil then
  costs = {}
  for c in string.gmatch(ARGV[4], '%-?%d+') do costs[#costs + 1] = tonumber(c) end
  if #costs ~= n_rates then return redis.error_reply('window.lua: ' .. n_rates .. ' rates, costs ' .. ARGV[4]) end
end

for i = 1, n_rates do fields[4 + i] = ARGV[20 + 3 * i] end
local stored = redis.call('HMGET', key, unpack(fields))
if stored[1] and stored[4] and tonumber(stored[4]) ~= STATE_FORMAT then
  -- Written in another format (a later version's, and the deploy rolled back): not read
  -- as this one, but started afresh, as a hash that expired would be.
  redis.call('DEL', key)
  for i = 1, #fields do stored[i] = false end
end
-- HMGET answers false for a missing field.
local epoch = stored[1] or nil
local delay = stored[2] and tonumber(stored[2]) or nil
local jitter = stored[3] and tonumber(stored[3]) or nil

-- How early reserved tasks are sent back (the reply's `lead`), -1 while nothing is learnt.
local function lead(half_pace)
  return delay and (delay + math.min(LEAD_JITTERS * jitter, half_pace)) or -1
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

-- The fast path: an 'acquire' (no lease asked) or 'screen' that fits now, nothing
-- paused. Each ALGO.fit answers only where its answer is the general path's own, so the
-- reply and the state written are the same (tests/test_model_check.py holds both to one
-- model); it only skips building the general path's tables and closures (Lua 5.1 makes
-- a closure of every function expression on every call): a few µs of a check whose
-- script takes 15. A state or call it does not take (a denial, a bucket leaving the
-- window, a fold due, ...) goes on to the general path, nothing written.
if n_rates > 0 and not_before == 0 and (op == 'screen' or (op == 'acquire' and lease <= (costs and 1 or cost))) then
  local record = op == 'acquire'
  local free, clear, shortest, half_pace, sets = nil, 0, nil, nil, {}
  for i = 1, n_rates do
    local limit, period = tonumber(ARGV[18 + 3 * i]), tonumber(ARGV[19 + 3 * i])
    local c = costs and costs[i] or cost
    local used, clear_at, value = nil, nil, nil
    if c <= limit then  -- (else TOO_COSTLY, below)
      used, clear_at, value = ALGO.fit(stored[4 + i] or nil, now, limit, period, c, now + slack, record)
    end
    if used == nil then sets = nil break end
    local f = limit - used - (record and c or 0)
    if free == nil or f < free then free = f end
    if clear_at > clear then clear = clear_at end
    if shortest == nil or period < shortest then shortest = period end
    local pace = math.floor(period / limit / 2)
    if half_pace == nil or pace < half_pace then half_pace = pace end
    if record then
      sets[#sets + 1] = fields[4 + i]
      sets[#sets + 1] = value
    end
  end
  if sets then
    if record then
      if epoch == nil then
        epoch = string.format('%.0f', now)
        sets[#sets + 1] = 'e'
        sets[#sets + 1] = epoch
        sets[#sets + 1] = 'f'
        sets[#sets + 1] = STATE_FORMAT
      end
      redis.call('HSET', key, unpack(sets))
      keep_until(clear, shortest)
    end
    return {RUN, 0, math.max(free, 0), clear, 0, 0, now, tonumber(epoch or '0'), lead(half_pace), 0, 0}
  end
end

ALGO.define()  -- (the algorithm's general functions: see its ALGO.define)
local rates = {}
local shortest, half_pace = nil, nil
for i = 1, n_rates do
  local r = {limit = tonumber(ARGV[18 + 3 * i]), period = tonumber(ARGV[19 + 3 * i]),
             field = fields[4 + i], cost = costs and costs[i] or cost, dirty = false}
  if shortest == nil or r.period < shortest then shortest = r.period end
  local pace = math.floor(r.period / r.limit / 2)
  if half_pace == nil or pace < half_pace then half_pace = pace end
  rates[i] = r
end
for i, r in ipairs(rates) do ALGO.load(r, stored[4 + i] or nil, now) end

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
  end
  if #dels > 0 then redis.call('HDEL', key, unpack(dels)) end
  if #sets == 0 then return end
  if epoch == nil then
    epoch = string.format('%.0f', now)
    sets[#sets + 1] = 'e'
    sets[#sets + 1] = epoch
    sets[#sets + 1] = 'f'
    sets[#sets + 1] = STATE_FORMAT
  end
  redis.call('HSET', key, unpack(sets))
  keep_until(clear_at(), shortest)
end

local function reply(code, wait, start, latest, given_grace, leased, rooms)
  return {code, wait, remaining(now), clear_at(), start, latest, now, tonumber(epoch or '0'),
          lead(half_pace), given_grace or 0, leased or 0, rooms}
end

-- A count of every rate (a number) or one per rate ('3,-500', as ARGV[4]): rate i's is
-- the result's [i].
local function per_rate(text)
  local out, one = {}, tonumber(text)
  for v in string.gmatch(text, '%-?%d+') do out[#out + 1] = tonumber(v) end
  if one then for i = 1, n_rates do out[i] = one end end
  if #out ~= n_rates then error('window.lua: ' .. n_rates .. ' rates, counts ' .. text) end
  return out
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

-- At publish, a task held back (by the window, or a pause) is counted for `status`.
local function count_held()
  if (op == 'admit' or op == 'reserve') and KEYS[2] ~= nil then
    redis.call('INCR', KEYS[2])
    redis.call('PEXPIRE', KEYS[2], HELD_COUNT_TTL_MS)
  end
end

-- The earliest start, from `from` on, that every rate admits: each earliest() only moves
-- it forward; settled once a round moves it no more.
local function earliest(from)
  local x, settled = from, false
  for _ = 1, SETTLE_ROUNDS do
    settled = true
    for _, r in ipairs(rates) do
      local e = ALGO.earliest(r, x, r.cost, slack)
      if e > x then x, settled = e, false end
    end
    if settled then break end
  end
  return x, settled
end

-- Nothing starts in a pause: the earliest any start may be.
local unpaused = math.max(now, not_before)

-- Record a start reserved at x, open for the grace (the caller's, widened by the jitter
-- learnt; that widening capped, the caller's least grace its own to cap). Returns the
-- latest start every rate allows it, and the grace given.
local function record_reserved(x)
  local given = grace
  if jitter ~= nil then
    given = math.max(given, math.min(GRACE_JITTERS * jitter + GRACE_SLACKS * slack,
                                     math.floor(shortest / LEARNT_CAP_PARTS)))
  end
  local latest = nil
  for _, r in ipairs(rates) do
    local until_ = ALGO.record(r, x, x + given, r.cost)
    r.dirty = true
    if latest == nil or until_ < latest then latest = until_ end
  end
  return latest, given
end

-- The decision of a check, from the earliest start on or after `from`: run now if it is
-- now (`runs`: 'record' records the start, with a lease of `lease_n` if it fits;
-- 'screen' records nothing, the pool's acquire will; nil: never now), else reserve that
-- start if `reserving` (unless further than the max wait), else deny.
local function check(runs, reserving, from, lease_n)
  if not_before - now > pause_horizon then
    -- A pause too long to reserve behind (a resume must let its tasks go): check later.
    write_back()  -- (a claim's units given back)
    count_held()
    return reply(DENIED, pause_horizon, 0, 0)
  end
  local x, settled = earliest(from)
  local code, start, latest, given, leased = DENIED, 0, 0, 0, 0
  if settled and x == now and runs == 'screen' then
    code = RUN
  elseif settled and x == now and runs == 'record' then
    code = RUN
    local n, span = nil, slack  -- (nil: this call alone)
    if lease_n > (costs and 1 or cost) then
      span = math.max(lease_span, slack)
      if lease_fits(lease_n, span) then n, leased = lease_n, lease_n else span = slack end
    end
    for _, r in ipairs(rates) do
      ALGO.record(r, now, now + span, n and lease_units(r, n) or r.cost)
      r.dirty = true
    end
  elseif settled and reserving and max_wait > 0 and x - unpaused > max_wait then
    code = TOO_FAR
  elseif settled and reserving then
    code, start = RESERVED, x
    latest, given = record_reserved(x)
  end
  write_back()
  if code ~= RUN and (x > from or not_before > now or not settled) then count_held() end
  return reply(code, x - now, start, latest, given, leased)
end

-- -- the operations (ARGV[2]) ------------------------------------------------------------

-- Admit now if every rate has room (recorded, with a lease if asked and it fits), else
-- deny, reserving a start if ARGV[3].
local function acquire()
  return check('record', reserve, unpaused, lease)
end

-- As acquire, but a call that fits now is not recorded: the worker's pool acquires it.
local function screen()
  return check('screen', reserve, unpaused, 0)
end

-- At publish: reserve a start even for a call that fits now, no sooner than the key's
-- learnt dispatch delay from now (the worker claims it when the task arrives).
local function reserve_start()
  local from = unpaused
  if delay ~= nil then from = math.max(from, now + lead(half_pace)) end
  return check(nil, true, from, 0)
end

-- At publish: a call that fits now, leaving every rate at most half full, is not
-- recorded (RUN, `leased` the room left before a rate is half full, and with a cost per
-- rate `rooms`, each rate's); any other reserves.
local function admit()
  if not_before == 0 and lease_fits(nil, slack) then
    -- (lease_fits: at most half of each rate used with this call, so the room is >= cost)
    local room, rooms = nil, costs and {} or nil
    for i, r in ipairs(rates) do
      local used = math.max(ALGO.usage(r, now), ALGO.usage(r, now + slack))
      local free = math.floor(r.limit / 2) - used
      if room == nil or free < room then room = free end
      if rooms then rooms[i] = free end
    end
    return reply(RUN, 0, 0, 0, 0, room, rooms)
  end
  return reserve_start()
end

-- Use a start reserved earlier: learn the trip back, run if on time, run at the start if
-- a little early (ARGV[19]), wait if earlier, give it back and check afresh if late. A
-- reservation of another epoch, or used already (its marker, KEYS[2], is set), is neither
-- honoured nor given back: the call is an acquire.
local function claim()
  if epoch ~= ARGV[11] or (KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1) then return acquire() end
  local c_start, c_latest = tonumber(ARGV[7]), tonumber(ARGV[8])
  local c_grace, c_lead = tonumber(ARGV[10]), tonumber(ARGV[12])
  -- (A trip back longer than LEARN_OUTLIER_MS is not a dispatch delay: no worker ran,
  -- or the releaser stopped, while the task waited. It is not learnt.)
  local trip = now - (c_start - c_lead)
  if ARGV[13] == '1' and trip <= LEARN_OUTLIER_MS * 1000 then
    local sample = math.max(0, math.min(trip, math.floor(shortest / LEARNT_CAP_PARTS)))
    if delay == nil then
      delay, jitter = sample, math.floor(sample / 2)
    else
      local err = sample - delay
      delay = delay + math.floor(err / DELAY_GAIN_PARTS)
      jitter = jitter + math.floor((math.abs(err) - jitter) / JITTER_GAIN_PARTS)
    end
    redis.call('HSET', key, 'd', string.format('%.0f', delay), 'v', string.format('%.0f', jitter))
  end
  -- Reserved before a pause that now covers its start: given back below, reserved again.
  local paused = c_start < not_before or ARGV[13] == '2'
  -- (Granted early, it starts at its start: it must leave the slack there.)
  local granted = now < c_start and c_start - now <= tonumber(ARGV[19]) and c_start + slack <= c_latest
  if now < c_start and not paused and not granted then return reply(EARLY, c_start - now, c_start, c_latest) end
  if KEYS[2] then
    -- Remember the use until its units have surely left every window.
    local longest = 0
    for _, r in ipairs(rates) do longest = math.max(longest, r.period) end
    local ttl = math.ceil((math.max(c_latest - now, 0) + longest) / 1000) + STATE_TTL_PAD_MS
    redis.call('SET', KEYS[2], '1', 'PX', ttl)
  end
  if granted and not paused then return reply(RUN_AT, c_start - now, c_start, c_latest) end
  -- On time: the body starts within `slack` of now, still inside the reserved span.
  if now + slack <= c_latest and not paused then return reply(RUN, 0, c_start, c_latest) end
  -- Too late to use the reserved start without breaking the window for whoever was
  -- placed after it: give it back and try afresh.
  local c_costs = per_rate(ARGV[9])
  for i, r in ipairs(rates) do
    ALGO.unrecord(r, c_start, c_grace, c_costs[i])
    r.dirty = true
  end
  return check('record', reserve, unpaused, 0)
end

-- A call that started reports its real cost: the difference is added to (or, a refund,
-- taken from) the span it was counted in, so later starts see what it really used. One
-- counted in another epoch (the state was reset or lost since) has nothing left to settle.
-- A call admitted from a lease (ARGV[7] '0': where in the lease's span it is counted is
-- not known) keeps a refund counted, and counts an overrun from now, over ARGV[8] (its
-- slack), whatever the epoch.
local function settle()
  local deltas = per_rate(ARGV[9])
  local at, latest = tonumber(ARGV[7]), tonumber(ARGV[8])
  local from_lease = at == 0
  if from_lease then
    at, latest = now, now + latest
  elseif epoch ~= ARGV[11] then
    return reply(RUN, 0, 0, 0)
  end
  for i, r in ipairs(rates) do
    local delta = deltas[i]
    -- (counted so long ago that nothing of it counts any more: nothing to settle; and
    -- a refund of a call admitted from a lease stays counted)
    if delta ~= 0 and latest + r.period > now and not (from_lease and delta < 0) then
      if delta > 0 then ALGO.record(r, at, latest, delta) else ALGO.unrecord(r, at, latest - at, -delta) end
      r.dirty = true
    end
  end
  write_back()
  return reply(RUN, 0, 0, 0)
end

-- Whether the call would fit now, and usage, recording nothing.
local function peek()
  local x = earliest(unpaused)
  return reply(x == now and RUN or DENIED, x - now, 0, 0)
end

-- The cost is checked here, once, for every operation (a settle's is what it reports).
if op == 'settle' then return settle() end
for _, r in ipairs(rates) do
  if r.cost > r.limit then return {TOO_COSTLY, 0, 0, 0, 0, 0, now, 0, -1, 0, 0} end
end
if op == 'acquire' then return acquire()
elseif op == 'screen' then return screen()
elseif op == 'reserve' then return reserve_start()
elseif op == 'admit' then return admit()
elseif op == 'claim' then return claim()
elseif op == 'peek' then return peek()
end
return redis.error_reply('window.lua: unknown op ' .. tostring(op))
