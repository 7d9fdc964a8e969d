-- The line of one (scope, key), after window.lua: tasks that could not start wait here,
-- first come first served within a priority (place_of), off the broker and out of every worker's memory, and the head
-- is released when the key has room as it is at that moment (the windows, the live limit
-- the caller says, what was reported, a pause, the concurrency slots).
--
-- Released means: taken out of the line with a ticket (its entry id, which nobody sees
-- before), its message handed to the caller to send to the broker, and its cost counted
-- as *out* until it arrives: a task released is counted in the window when it really
-- starts, and the key never has more released and not started than it has room for
-- (out units are set beside the window's own in every check). A released task that
-- arrives with room starts; a little early, it is granted its start (RUN_AT); with no room
-- (an overrun reported since, a lowered limit) it goes back to its place at the front of
-- the line. A fresh call starts only if nobody waits and there is room beside what is
-- out: nothing overtakes the line.
--
-- Entries: KEYS[3] holds entry -> its place (a counter; a task put back keeps its place,
-- one sent back by Backoff goes before everyone); KEYS[4] holds entry -> its message and
-- entry .. '#' -> a MessagePack array (the fields of M below); KEYS[5] holds each entry
-- released -> when its time is up: unacked (the caller died before sending it) it is put
-- back after SEND_LEASE_MS; sent and never arrived it is forgotten after OUT_LEASE_MS
-- (logged by the caller; if it comes later, it is checked as a fresh call); granted a
-- start (RUN_AT) its entry is kept GRANT_KEEP_MS past that start, for a process that woke
-- too late for it. A slot handed to a released task is held in the entry's name until that
-- time; a running body's, in its holder's (a delivery id), renewed by its process.
--
-- KEYS[7] holds the entries that started lately (entry -> when), for USED_KEEP_MS, and
-- beside each the nonce of the holder that started it (entry .. '@' .. nonce -> when; a
-- holder ends in ':' and its nonce, which every delivery of one task sent again after a
-- lost reply keeps): a copy sent again by that task, whose reply was lost (it never heard
-- of its start, and ran nothing), names it and is checked again, not dropped as a copy of
-- a task that ran.
--
-- KEYS[2], the line's counts: 'q' tasks in line, 's' the last place given, 'b' the first
-- (places before 0: sent back to the front), 'o' units out by unit, 'u' units in line by
-- unit (MessagePack arrays unit, n, ...), 'c' entries released and not started, 'x' the
-- due time the index was last told (and 'xt' when): on a single Redis the call tells the
-- index of keys with a line (index.lua's KEYS, passed as KEYS[9..11]) itself (tell_index);
-- on a Redis Cluster the index lives on other slots, so the caller writes it when the
-- reply says.
--
-- Operations: a script each, lua/op/<operation>.lua (what it does and its own arguments,
-- ARGV[P..], P = 11 + 3 * rates), run by its own name (store/window.py): the loader puts
-- before it window.lua, this file and the includes, keeping only the functions it reaches,
-- so that a call makes none of another operation's closures (Lua 5.1 makes one of each
-- function on every run, and one made late in a long script costs about 1 µs).
-- The entry's arguments: [E] entry id, [E+1] message ('' none), [E+2] task id, [E+3]
-- expires (µs, 0 none), [E+4] max wait (µs, 0 none), [E+5] batch, [E+6] the nonce of the
-- holder of this task's own call whose reply was lost ('' none; see KEYS[7]), [E+7] its
-- urgency: levels of priority ahead of its broker's default (negative: behind; see place_of).
--
-- Codes (protocol.Code): RUN, RUN_AT, DENIED, QUEUED, RELEASED, TOO_FAR, TOO_COSTLY,
-- WAITED, LOST (ended, renew: a slot's lease had run out), DUPLICATE (a copy of a task that
-- started lately: its ticket, or the entry it names, was used), STALE (claim). `due` is
-- when the key next needs a look (its head fits, an entry's time is up; 0: never, nothing
-- waits), and `index` whether the caller must tell the index so (1: if earlier, 2:
-- whatever it holds).
-- Reported tasks, {id, payload, kind}: 'r' released (payload: its message; send it with
-- its ticket), 'x' expired while waiting (its message; sent as it is, the worker discards
-- it), 'c' costs more than a limit now in force (it joined under a higher live limit,
-- cleared since; its message, sent as it is: the worker's check fails it, visibly), 'l'
-- its message is gone (payload: task id), 'f' released and never arrived (payload: task
-- id), 'd' deleted by an operator (payload: task id), for renew the holders lost.
local lm_key, line_key, msgs_key, out_key, slots_key, used_key = KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
-- An entry's fields (one table, not a local each: a Lua function sees 60 upvalues at most).
local M = {TASK = 1, UNITS = 2, ENQUEUED = 3, EXPIRES = 4, MAX_WAIT = 5, PLACE = 6, PHASE = 7, RELEASED = 8,
           START = 9, LATEST = 10, EPOCH = 11, CONTROLS = 12}

-- The controls this call was made under, as they bear on a start: the pause in force, the
-- concurrency limit, each rate's limit and period. Kept with each entry released; a claim
-- made under other ones that would send it back says STALE instead (its process had not
-- read a resume or a raised limit yet: it reads the controls and claims again).
-- (Made when first needed: most calls release nothing and claim nothing.)
local seen_controls = nil
local function controls_seen()
  if seen_controls == nil then
    local parts = {string.format('%.0f', not_before), string.format('%.0f', concurrency)}
    for _, r in ipairs(rates) do
      parts[#parts + 1] = string.format('%.0f', r.limit)
      parts[#parts + 1] = string.format('%.0f', r.period)
    end
    seen_controls = table.concat(parts, ',')
  end
  return seen_controls
end

-- A map of units by unit from its flat array {unit, n, ...} (anything else counts nothing).
local function map_of(flat)
  local map = {}
  if type(flat) == 'table' then
    for i = 1, #flat - 1, 2 do
      if type(flat[i]) == 'string' and type(flat[i + 1]) == 'number' then map[flat[i]] = flat[i + 1] end
    end
  end
  return map
end

local function stored_map(raw)
  if not raw then return {} end
  local ok, flat = pcall(cmsgpack.unpack, raw)
  return ok and map_of(flat) or {}
end

local function flat_of(map)
  local flat, names = {}, {}
  for unit in pairs(map) do names[#names + 1] = unit end
  table.sort(names)  -- (one encoding of one map: the reference compares bytes)
  for _, unit in ipairs(names) do
    flat[#flat + 1] = unit
    flat[#flat + 1] = map[unit]
  end
  return flat
end

local function add_units(map, units, sign)
  for unit, n in pairs(units) do
    local v = (map[unit] or 0) + sign * n
    if v > 0 then map[unit] = v else map[unit] = nil end
  end
end

local lm = redis.call('HMGET', lm_key, 'q', 's', 'b', 'o', 'u', 'c', 'x', 'xt')
local waiting, last_place, first_place = tonumber(lm[1]) or 0, tonumber(lm[2]) or 0, tonumber(lm[3]) or 0
local out_units, line_units = stored_map(lm[4]), stored_map(lm[5])
local out_count, indexed, indexed_at = tonumber(lm[6]) or 0, tonumber(lm[7]) or 0, tonumber(lm[8]) or 0
local existed = waiting > 0 or out_count > 0
local reported = {}

local function report(id, payload, kind)
  reported[#reported + 1] = id
  reported[#reported + 1] = payload
  reported[#reported + 1] = kind
end

-- The call's own cost by unit.
local call_by_unit = {}
for _, r in ipairs(rates) do call_by_unit[r.unit] = r.cost end

-- Per rate: what an entry costs (a unit it does not name costs 1: it was made under rates
-- of other units, a live limit set since).
local function units_of(m)
  local map, t = map_of(m[M.UNITS]), {}
  for i, r in ipairs(rates) do t[i] = map[r.unit] or 1 end
  return t
end

-- Units out, per rate, less `own` (an entry's, per rate) if given.
local function out_per_rate(own)
  local t = {}
  for i, r in ipairs(rates) do t[i] = (out_units[r.unit] or 0) - (own and own[i] or 0) end
  return t
end

-- The places of the line: a counter ('s', the last given), less `urgency` times
-- PRIORITY_STEP for a task of another priority than its broker's default, and half a place
-- more toward the front (behind: toward the back), so that such a place is never 0 nor a
-- counter's. A task of urgency u goes before the u * PRIORITY_STEP tasks that came last
-- before it, first come first served within a level; one of urgency -u goes after the
-- u * PRIORITY_STEP that come next after it. So nothing waits behind more than
-- (v - u) * PRIORITY_STEP tasks that came after it, v the highest urgency among them (the
-- aging rule: core/priority.py).
local function place_of(given, urgency)
  if urgency == 0 then return given end
  return given - urgency * PRIORITY_STEP - (urgency > 0 and 0.5 or -0.5)
end

-- The counter a place was given at, at most (counted again from the places: a place of
-- another priority tells its counter only within MOST_URGENCY levels).
local function last_given(place)
  if place == math.floor(place) then return place end
  return math.floor(place) + MOST_URGENCY * PRIORITY_STEP + 1
end

-- An entry's fields from what KEYS[4] holds of them (nil: none, or not an entry's).
local function meta_from(raw)
  if not raw then return nil end
  local ok, m = pcall(cmsgpack.unpack, raw)
  if ok and type(m) == 'table' and type(m[M.UNITS]) == 'table' and type(m[M.PHASE]) == 'string' then return m end
  return nil
end

local function meta_of(id)
  return meta_from(redis.call('HGET', msgs_key, id .. '#'))
end

-- The line's head as release_heads last left it in line, {id, its fields}, while the line
-- and the entries are as they were then (join, leave, set_meta and forget drop it): the
-- reply's next_due reads it from here rather than from the store again.
local head_seen = nil

local function set_meta(id, m)
  head_seen = nil
  redis.call('HSET', msgs_key, id .. '#', cmsgpack.pack(m))
end

local function forget(id)
  head_seen = nil
  redis.call('HDEL', msgs_key, id, id .. '#')
end

-- A line whose counts are gone while its entries stay (a store evicting under allkeys-lru
-- takes one key of a line and may leave the others) is counted again from its entries,
-- on the call that finds it so: else it would be taken for empty, dropped from the index,
-- and its tasks left in it for good. (Its entries once each: a line evicted in part. The
-- index's due time is not known either: the call tells the index of the key again.)
-- (The counts are written whole and deleted whole: none of them, no counts. Most keys
-- without them have no line either: one look says so.)
local uncounted = not lm[1] and not lm[6]
if uncounted and redis.call('EXISTS', line_key, out_key) > 0 then
  local places = redis.call('ZRANGE', line_key, 0, -1, 'WITHSCORES')
  local outs = redis.call('ZRANGE', out_key, 0, -1)
  if #places > 0 or #outs > 0 then
    waiting, out_count = #places / 2, #outs
    first_place = math.min(0, math.floor(tonumber(places[2]) or 0))
    last_place = math.max(0, last_given(tonumber(places[#places]) or 0))
    for i = 1, #places, 2 do
      local m = meta_of(places[i])
      add_units(line_units, m and map_of(m[M.UNITS]) or call_by_unit, 1)
    end
    for _, id in ipairs(outs) do
      local m = meta_of(id)
      if m then
        if m[M.PHASE] ~= 'g' then add_units(out_units, map_of(m[M.UNITS]), 1) end
        last_place = math.max(last_place, last_given(tonumber(m[M.PLACE]) or 0))
      end
    end
  end
end

-- -- slots --------------------------------------------------------------------------------

-- Whether the key's slots hold anyone, or may: always under a concurrency limit; without
-- one, only where a zset is left from a limit since lifted (its leases run out by
-- themselves). Read once a call: without a limit nothing adds a slot where no zset is (a
-- slot is taken under a limit, or kept by a holder that has one), so a key of rates alone
-- pays one EXISTS a call for its slots, not a command at each look.
local slots_there = nil
local function any_slots()
  if concurrency > 0 then return true end
  if slots_there == nil then slots_there = redis.call('EXISTS', slots_key) == 1 end
  return slots_there
end

-- The slots of `...` (entries or holders) go.
local function drop_slots(...)
  if any_slots() then redis.call('ZREM', slots_key, ...) end
end

-- Running leases that ran out (a worker that died holding them). A slot handed to a
-- released task goes with its entry (expire_out).
local function reclaim()
  if any_slots() then redis.call('ZREMRANGEBYSCORE', slots_key, '-inf', now) end
end

local function slots_held()
  return any_slots() and redis.call('ZCARD', slots_key) or 0
end

local function slot_free()
  return concurrency == 0 or slots_held() < slot_cap
end

-- The slot of a task that starts, held by `holder` (its delivery) until `until_` (renewed
-- by its process): the one handed to its entry `handed` when it was released, else one
-- taken now (with a limit).
local function hold(holder, until_, handed)
  if not any_slots() then return 0 end
  local had = handed ~= nil and redis.call('ZREM', slots_key, handed) == 1
  if concurrency > 0 or had or redis.call('ZSCORE', slots_key, holder) then
    redis.call('ZADD', slots_key, until_, holder)
    return 1
  end
  return 0
end

-- -- the line ---------------------------------------------------------------------------

-- (`message`: its message too, kept in the same write: one that joins the line first)
local function join(id, m, place, message)
  head_seen = nil
  m[M.PLACE], m[M.PHASE] = place, 'w'
  if message then
    redis.call('HSET', msgs_key, id, message, id .. '#', cmsgpack.pack(m))
  else
    set_meta(id, m)
  end
  redis.call('ZADD', line_key, place, id)
  waiting = waiting + 1
  add_units(line_units, map_of(m[M.UNITS]), 1)
end

local function leave(id, m)
  head_seen = nil
  if redis.call('ZREM', line_key, id) == 1 then
    waiting = waiting - 1
    if m then add_units(line_units, map_of(m[M.UNITS]), -1) end
  end
end

local function new_meta(task_id, expires, max_wait)
  return {task_id, flat_of(call_by_unit), now, expires, max_wait, 0, 'w', 0, 0, 0, 0}
end

-- A place before everyone in the line (a task sent back by Backoff, one released at
-- publish that finds no room): before the first place given at the front, and before the
-- line's head, whatever its priority.
local function front_place()
  local head = redis.call('ZRANGE', line_key, 0, 0, 'WITHSCORES')[2]
  first_place = math.min(first_place, math.floor(tonumber(head) or 0)) - 1
  return first_place
end

-- A new entry at the back, by its `urgency` (see place_of), or (`front`) before everyone
-- of the line, with its message.
local function enqueue(id, message, m, front, urgency)
  local place
  if front then
    place = front_place()
  else
    last_place = last_place + 1
    place = place_of(last_place, urgency or 0)
  end
  join(id, m, place, message)
end

-- Out: released, not started. Its slot, with a concurrency limit, is handed to it.
local function go_out(id, m, phase, until_)
  m[M.PHASE], m[M.RELEASED], m[M.CONTROLS] = phase, now, controls_seen()
  set_meta(id, m)
  redis.call('ZADD', out_key, until_, id)
  out_count = out_count + 1
  add_units(out_units, map_of(m[M.UNITS]), 1)
  if concurrency > 0 then redis.call('ZADD', slots_key, math.min(until_, now + HANDED_SLOT_MS * 1000), id) end
end

-- No longer out (it arrived, its time is up, or it will not start).
local function come_in(id, m)
  if redis.call('ZREM', out_key, id) == 1 then
    out_count = out_count - 1
    if m[M.PHASE] ~= 'g' then add_units(out_units, map_of(m[M.UNITS]), -1) end
  end
end

-- Give back the start granted to entry `m` ahead (RUN_AT), if it was counted in the
-- windows of now (a reset, or a lost state, since: nothing of it is left to give back).
local function ungrant(m)
  if m[M.PHASE] == 'g' and m[M.EPOCH] == tonumber(epoch or '0') then
    unrecord(m[M.START], m[M.LATEST] - m[M.START], units_of(m))
  end
end

-- The tasks released with the tickets ARGV[from..] were sent: their time out is
-- OUT_LEASE_MS from now (their messages stay until they start, for one that finds no room
-- then). A ticket no longer out (it started, or went back) is passed over.
local function ack_sent(from)
  for i = from, #ARGV do
    local ticket = ARGV[i]
    local m = redis.call('ZSCORE', out_key, ticket) and meta_of(ticket)
    if m and m[M.PHASE] == 's' then
      m[M.PHASE] = 'o'
      set_meta(ticket, m)
      redis.call('ZADD', out_key, now + OUT_LEASE_MS * 1000, ticket)
      if any_slots() and redis.call('ZSCORE', slots_key, ticket) then
        redis.call('ZADD', slots_key, now + math.min(OUT_LEASE_MS, HANDED_SLOT_MS) * 1000, ticket)
      end
    end
  end
end

-- Entries whose time is up (at most `batch`). (None out, none to look for: the count of
-- those out moves with every entry that goes out or comes in, and is counted again from
-- the entries when it is gone.)
local function expire_out(batch)
  if out_count == 0 then return end
  local due = redis.call('ZRANGEBYSCORE', out_key, '-inf', now, 'LIMIT', 0, batch)
  for _, id in ipairs(due) do
    local m = meta_of(id)
    if m == nil then
      redis.call('ZREM', out_key, id)
      out_count = out_count - 1
      drop_slots(id)
      forget(id)
    elseif m[M.PHASE] == 'g' then
      come_in(id, m)
      forget(id)  -- (granted a start, and took it: done; its slot is its running body's)
    else
      come_in(id, m)
      drop_slots(id)
      if m[M.PHASE] == 's' and redis.call('HEXISTS', msgs_key, id) == 1 then
        join(id, m, m[M.PLACE])  -- never sent (its releaser died): back in its place
      else
        forget(id)
        report(id, m[M.TASK], 'f')
      end
    end
  end
end

-- Whether `units` (per rate) can never fit one of the rates in force (it joined under a
-- higher live limit, cleared since): it does not hold up the line for ever.
local function too_costly(units)
  for i, r in ipairs(rates) do
    if units[i] > r.limit then return true end
  end
  return false
end

-- Release the heads that fit (`anyway`: whatever the room), looking at most at `batch`. A
-- head fits when nothing pauses the key, a slot is free, and every rate admits it beside
-- what is out by now + lead (a released task takes that long to arrive; one that arrives
-- early is granted its start). A negative `batch`: only heads whose message is gone go
-- (reported lost), -batch at most, and the first that has its message stays, whatever the
-- call's rates (a releaser that has no task of the line to bind them with: its head's
-- message was evicted; else the line would wait on that head for good).
local function release_heads(batch, anyway)
  local lost_only = batch < 0
  if lost_only then batch = -batch end
  local looked, lead_now = 0, lead(half_pace)
  while looked < batch and waiting > 0 do
    looked = looked + 1
    local head = redis.call('ZRANGE', line_key, 0, 0)[1]
    if head == nil then waiting = 0 break end
    local kept = redis.call('HMGET', msgs_key, head .. '#', head)  -- (its fields and its message)
    local m, message = meta_from(kept[1]), kept[2]
    if m == nil or not message then
      leave(head, m)
      forget(head)
      report(head, m and m[M.TASK] or head, 'l')
    elseif lost_only then
      head_seen = {head, m}
      break
    elseif m[M.EXPIRES] > 0 and m[M.EXPIRES] <= now then
      leave(head, m)
      forget(head)
      report(head, message, 'x')
    elseif too_costly(units_of(m)) then
      leave(head, m)
      forget(head)
      report(head, message, 'c')
    else
      if not anyway then
        if not_before > 0 or not slot_free() then head_seen = {head, m} break end
        local at = earliest(now, units_of(m), out_per_rate())
        if at == nil or at > now + lead_now then head_seen = {head, m} break end
      end
      leave(head, m)
      go_out(head, m, 's', now + SEND_LEASE_MS * 1000)
      report(head, message, 'r')
    end
  end
end

-- When the key next needs a look: its head may go (or expires), a pause ends, a slot's
-- lease runs out, an entry's time is up. FOREVER_US while something waits only on what a
-- call changes (a pause until resumed, what is out); 0 when nothing waits; now when its
-- line just emptied (the index drops it then).
local function next_due()
  local due = nil
  local function at(t)
    if due == nil or t < due then due = t end
  end
  if waiting > 0 then
    local m = head_seen and head_seen[2]
    if m == nil then
      local head = redis.call('ZRANGE', line_key, 0, 0)[1]
      m = head and meta_of(head)
    end
    if m == nil then
      at(now)  -- (its message is gone: the next look reports it)
    else
      if m[M.EXPIRES] > 0 then at(m[M.EXPIRES]) end
      if not_before > 0 then
        at(math.max(not_before - lead(half_pace), now))
      elseif not slot_free() then
        local first = redis.call('ZRANGE', slots_key, 0, 0, 'WITHSCORES')
        if first[2] then at(tonumber(first[2])) end
      else
        local x = earliest(now, units_of(m), out_per_rate())
        if x then at(math.max(x - lead(half_pace), now)) end
      end
    end
  end
  if out_count > 0 then
    local first_out = redis.call('ZRANGE', out_key, 0, 0, 'WITHSCORES')
    if first_out[2] then at(tonumber(first_out[2])) end
  end
  if due == nil and (waiting > 0 or out_count > 0) then due = FOREVER_US end
  if due == nil and existed then due = now end
  return due or 0
end

local function remaining_beside_out()
  local free = nil
  for _, r in ipairs(rates) do
    local f = r.limit - ALGO.usage(r, now) - (out_units[r.unit] or 0)
    if free == nil or f < free then free = f end
  end
  return math.max(free or 0, 0)
end

-- A start of a delivery whose reply was lost, taken back by this call (see unuse): the
-- member that named it and its time, the holder's slot and its lease (false: none).
local unused = nil

-- A call that changes nothing (DENIED: it calls again with its message; STALE) puts it
-- back as it was, for that next call to take back.
local function keep_unused(code)
  if unused and (code == DENIED or code == STALE) then
    redis.call('ZADD', used_key, unused[2], unused[1])
    if unused[4] then redis.call('ZADD', slots_key, unused[4], unused[3]) end
  end
  unused = nil
end

-- Tell the index of keys with a line (KEYS[9..11]: a single Redis) when this key next needs a
-- look: index.lua's 'note' (the newest computation wins; one computed under controls read
-- before the key's last wake-up may bring its look earlier, never later), and a releaser
-- woken if it is soon. A line that emptied leaves the index (a releaser's look would find
-- nothing, and settle it so). In the same run as the line's own counts, whose 'x' says the
-- index was told: no lost reply or caller that dies can leave a line the index never heard
-- of (its tasks waited for the releasers' sweep).
local function tell_index(due, emptied)
  local index, at_key = KEYS[9], KEYS[10]
  if now < (tonumber(redis.call('HGET', at_key, key) or '') or 0) then return end  -- (a newer note holds)
  if emptied then
    redis.call('ZREM', index, key)
    redis.call('HDEL', at_key, key, key .. '#w')
    return
  end
  if controls_read > 0 and controls_read < (tonumber(redis.call('HGET', at_key, key .. '#w') or '') or 0) then
    local held = redis.call('ZSCORE', index, key)
    if held and due > tonumber(held) then return end
  end
  redis.call('ZADD', index, due, key)
  redis.call('HSET', at_key, key, string.format('%.0f', now))
  if due - now < WAKE_AHEAD_MS * 1000 then
    redis.call('LPUSH', KEYS[11], due > now and ('p0@' .. string.format('%.0f', due)) or 'p0')
    redis.call('PEXPIRE', KEYS[11], WAKE_TTL_MS)
  end
end

-- The reply: window.lua's head, the line's counts and what the index must be told
-- (`release_op`: the releaser's, which writes the index itself; `readonly`: nothing
-- written), and the tasks reported.
local function finish(code, wait, f, release_op, readonly)
  f = f or {}
  keep_unused(code)
  -- (no slot held: the reply's count of those running is 0 without a look; nothing below
  -- takes a slot)
  local no_slots = false
  if not readonly then
    write_back()
    -- The slots' holders go by themselves when every lease in them has run out.
    local last = any_slots() and redis.call('ZRANGE', slots_key, -1, -1, 'WITHSCORES') or {}
    if last[2] then
      redis.call('PEXPIRE', slots_key, math.max(math.ceil((tonumber(last[2]) - now) / 1000), 1) + STATE_TTL_PAD_MS)
    else
      no_slots = true
    end
  end
  local due, index = next_due(), 0
  if not readonly then
    if waiting == 0 and out_count == 0 then
      if not uncounted then redis.call('DEL', lm_key) end  -- (only finish writes them)
      if existed and not release_op then index = 1 end  -- (emptied: the index drops it)
      if index > 0 and KEYS[9] then
        tell_index(due, true)
        index = 0
      end
    else
      if not existed then
        index = 2
      elseif due > 0 and (indexed == 0 or due < indexed or indexed_at < now - INDEX_STALE_MS * 1000) then
        index = 1
      end
      if release_op then index = 0 end
      if index > 0 or release_op then indexed, indexed_at = due, now end
      if index > 0 and KEYS[9] then
        tell_index(due, false)
        index = 0
      end
      redis.call('HSET', lm_key, 'q', waiting, 's', string.format('%.0f', last_place),
                 'b', string.format('%.0f', first_place), 'o', cmsgpack.pack(flat_of(out_units)),
                 'u', cmsgpack.pack(flat_of(line_units)), 'c', out_count,
                 'x', string.format('%.0f', indexed), 'xt', string.format('%.0f', indexed_at))
    end
  end
  f.code, f.wait_us, f.remaining, f.clear_at_us = code, wait, remaining_beside_out(), clear_at()
  f.lead_us, f.waiting, f.out, f.due_us, f.tell_index = lead(half_pace), waiting, out_count, due, index
  f.running = f.running or (no_slots and 0 or slots_held())  -- (shadow mode tells the bodies that ran beside it)
  return reply(f, reported)
end

-- The wait of a call behind the line and what is out (an estimate: see window.lua).
local function wait_of(units)
  local ahead = {}
  for i, r in ipairs(rates) do ahead[i] = (line_units[r.unit] or 0) + (out_units[r.unit] or 0) end
  return estimate(math.max(now, not_before), units, ahead) - now
end

-- -- the operations -----------------------------------------------------------------------

-- A call's entry, from ARGV[e..e+7]: id, message, task id, expires, max wait, batch, the
-- nonce of a lost holder, urgency.
local function entry_at(e)
  return {id = ARGV[e], message = ARGV[e + 1], task = ARGV[e + 2], expires = tonumber(ARGV[e + 3]),
          max_wait = tonumber(ARGV[e + 4]), batch = tonumber(ARGV[e + 5]), lost = ARGV[e + 6],
          urgency = math.max(-MOST_URGENCY, math.min(MOST_URGENCY, math.floor(tonumber(ARGV[e + 7]) or 0)))}
end

-- A call that cannot start now: it waits in the line if its message came, else the
-- caller sends it (DENIED); TOO_FAR if it would wait past its max wait.
local function wait_in_line(a, front)
  local wait = wait_of(call_units)
  if a.max_wait > 0 and concurrency == 0 and wait > a.max_wait then return TOO_FAR, wait end
  if a.message == '' then return DENIED, wait end
  enqueue(a.id, a.message, new_meta(a.task, a.expires, a.max_wait), front, a.urgency)
  return QUEUED, wait
end

-- Whether a fresh call may start now: nobody waits, nothing pauses it, a slot is free,
-- and every rate admits it beside what is out.
local function fresh_fits()
  return waiting == 0 and not_before == 0 and slot_free() and earliest(now, call_units, out_per_rate()) == now
end

-- Whether entry `id` already waits in the line or is out: a task sent again after a call
-- whose reply was lost (the store went away mid-call) names the entry it may hold, and is
-- told it waits there already, not let in twice. Its fields alone are no entry: a store
-- evicting (allkeys-lru) may take the line or the out set and leave them, and a copy told
-- it waits in no line would be acked and lost.
local function known_entry(id)
  return id ~= '' and redis.call('HEXISTS', msgs_key, id .. '#') == 1
    and (redis.call('ZSCORE', line_key, id) or redis.call('ZSCORE', out_key, id)) ~= false
end

-- Whether entry `id` started lately (USED_KEEP_MS): a copy of a task that ran (a copy sent
-- again after a store error, or one the broker delivered twice) is told so, and dropped.
local function used(id)
  return id ~= '' and redis.call('ZSCORE', used_key, id) ~= false
end

local function use(id, holder)
  redis.call('ZREMRANGEBYSCORE', used_key, '-inf', now - USED_KEEP_MS * 1000)
  redis.call('ZADD', used_key, now, id)
  local nonce = string.match(holder, ':(%x+)$')
  if nonce then redis.call('ZADD', used_key, now, id .. '@' .. nonce) end
  redis.call('PEXPIRE', used_key, USED_KEEP_MS)
end

-- Whether entry `id` was started lately by a holder of nonce `lost` whose reply was lost:
-- the copy that names it is that task, which never ran.
local function lost_start(id, lost)
  return lost ~= '' and id ~= '' and redis.call('ZSCORE', used_key, id .. '@' .. lost) ~= false
end

-- That start never ran: it names it no more (used once), and the slot its holder took
-- goes (its body never began; `holder`, of the same nonce, is the copy's: in the worker
-- that lost the reply, the same holder).
local function unuse(id, lost, holder)
  local member = id .. '@' .. lost
  unused = {member, redis.call('ZSCORE', used_key, member), holder,
            any_slots() and redis.call('ZSCORE', slots_key, holder)}
  redis.call('ZREM', used_key, member)
  drop_slots(holder)
  return true
end

-- A released task arriving (claim's own work, defined below): forward-declared, as a fresh
-- call may be one.
local arrive

-- A fresh call (`runs`: recorded if it fits; else the pool's acquire will). `a`: its
-- entry, and `lease`, `lease_span`, `holder`. `again`: the process that was granted the
-- start of entry `a.id` and woke too late even for the grant's keep, or the delivery that
-- started it and lost the reply: it started nothing, and is not a copy of a task that
-- started. A start after such a check is used in the delivery's name, as a claim's is.
local function fresh(runs, a, again)
  local code, wait, f = RUN, 0, {}
  local lost = not again and lost_start(a.id, a.lost)
  local out_m = known_entry(a.id) and redis.call('ZSCORE', out_key, a.id) and meta_of(a.id)
  if out_m and out_m[M.PHASE] ~= 'g' and not redis.call('ZSCORE', line_key, a.id) then
    -- A copy of a task released from this line that names its entry (sent unchecked by a
    -- producer whose admit released it and whose reply was lost, or sent back after a
    -- store error): it is that task arriving. The pool's check claims it; the consumer
    -- lets it through to the pool. (Told it waits, it would be acked while nothing waits.)
    if runs then
      write_back()
      return arrive(a.id, 0, a.holder, 0, a, false)
    end
    release_heads(a.batch)
    return finish(RUN, 0, f)
  elseif known_entry(a.id) then
    code = QUEUED
  elseif not again and used(a.id) and not lost then
    code = DUPLICATE
  elseif lost and runs and unuse(a.id, a.lost, a.holder) then
    return fresh(runs, a, true)
  elseif fresh_fits() then
    if runs then
      local units, span = call_units, slack
      -- A lease only while nothing waits or is out: the line is served first.
      if a.lease > (costs and 1 or cost) and out_count == 0 and concurrency == 0 then
        local wide = math.max(a.lease_span, slack)
        if lease_fits(a.lease, wide) then
          units, span, f.leased = {}, wide, a.lease
          for i, r in ipairs(rates) do units[i] = lease_units(r, a.lease) end
        end
      end
      record(now, now + span, units)
      if again then use(a.id, a.holder) end  -- (a task checked again: a later copy of it is one)
      if concurrency > 0 then
        redis.call('ZADD', slots_key, now + slot_lease, a.holder)
        f.held = 1
      end
    end
  else
    code, wait = wait_in_line(a, false)
  end
  release_heads(a.batch)
  return finish(code, wait, f)
end

-- A released task arrives with its ticket. A start granted to it is used once: another
-- claim of that ticket (a copy of its message) is a fresh call, unless it names the start
-- (the process it was granted to, which woke too late for it: that start is given back,
-- and it is checked as an arrival now).
-- The windows as stored, for a call that writes none of its own changes back (its reply
-- tells them as they stay, not as the call had changed them before it gave up).
local function as_stored()
  local raw = redis.call('HMGET', key, unpack(fields))
  for i, r in ipairs(rates) do
    ALGO.load(r, raw[4 + i] or nil, now)
    r.dirty = false
  end
end

-- A released task arrives with `ticket` (its entry; `a` as a fresh call's), from its
-- process `holder`: it may come as early as twice the lead it was released with (or 4
-- slacks), at most `early_cap`, and be granted its start; `granted`: the start granted to
-- this process before, which it woke too late for (0: none); `stale_ok`: see claim.
arrive = function(ticket, early_cap, holder, granted, a, stale_ok)
  local early = math.min(early_cap, math.max(2 * lead(half_pace), 4 * slack))
  local m = redis.call('ZSCORE', out_key, ticket) and meta_of(ticket)
  -- Put back in its place before it came (never acked: its sender died, or the worker it
  -- was handed to took longer than the send lease): it is that task, and leaves the line
  -- as it arrives; as a fresh call beside its own entry it would run twice.
  local in_line = false
  if not m and redis.call('ZSCORE', line_key, ticket) then
    m = meta_of(ticket)
    in_line = m ~= nil
  end
  -- The task's own delivery that claimed it before, whose reply was lost: that start
  -- never ran. A start it was granted ahead is given back as a process woken too late
  -- gives it back; one it was let in on stays counted (the store cannot tell it from a
  -- body that ran until the copy comes), and the copy is checked again.
  local lost = lost_start(ticket, a.lost)
  if lost then
    unuse(ticket, a.lost, holder)
    if m and m[M.PHASE] == 'g' and granted == 0 then granted = m[M.START] end
  end
  if m and m[M.PHASE] == 'g' and (granted == 0 or granted ~= m[M.START]) then m = nil end
  if not m then
    -- A copy of a task that started on this ticket lately: dropped. (Not the process the
    -- ticket's start was granted to, which names it: it woke too late even for the grant's
    -- keep, and started nothing: a fresh call. Nor the delivery whose reply was lost.)
    if used(ticket) and granted == 0 and not lost then
      release_heads(a.batch)
      return finish(DUPLICATE, 0)
    end
    -- Not released by this store (forged, its time up, its state lost): a fresh call.
    if too_costly(call_units) then return finish(TOO_COSTLY, 0) end
    a.lease, a.lease_span, a.holder = 0, 0, holder
    return fresh(true, a, granted ~= 0 or lost)
  end
  local waited, phase, units = now - m[M.ENQUEUED], m[M.PHASE], units_of(m)
  if too_costly(units) or (a.max_wait > 0 and waited > a.max_wait) then
    -- It costs more than a limit in force now (a live limit lowered or cleared), or it
    -- waited past its max wait (a limit lowered, a long pause): it leaves, its room back.
    come_in(ticket, m)
    if in_line then leave(ticket, m) end
    ungrant(m)
    drop_slots(ticket)
    forget(ticket)
    release_heads(a.batch)
    return finish(too_costly(units) and TOO_COSTLY or WAITED, 0, {waited_us = waited})
  end
  if phase ~= 'g' and stale_ok and m[M.CONTROLS] ~= nil and m[M.CONTROLS] ~= controls_seen() then
    -- Released under other controls than the caller's: if it would go back for them, the
    -- caller reads the controls and claims again (nothing written but what was due).
    -- (Without a concurrency limit every slot is free: no look at the slots it holds.)
    local own_slot = concurrency == 0 or redis.call('ZSCORE', slots_key, ticket) or redis.call('ZSCORE', slots_key, holder)
    local x = nil
    if not_before == 0 and (own_slot or slot_free()) then x = earliest(now, units, out_per_rate(units)) end
    if x == nil or x - now > early then
      as_stored()
      return finish(STALE, 0, {waited_us = waited})
    end
  end
  if in_line then leave(ticket, m) end
  if phase == 'g' then
    ungrant(m)
  elseif m[M.RELEASED] > 0 and not in_line then
    -- Learn how long a released task takes to arrive, the way TCP learns a round trip
    -- (a trip longer than LEARN_OUTLIER_MS is not a dispatch delay: no worker ran).
    local trip = now - m[M.RELEASED]
    if trip <= LEARN_OUTLIER_MS * 1000 then
      local sample = math.max(0, math.min(trip, math.floor(shortest / LEARNT_CAP_PARTS)))
      if delay == nil then
        delay, jitter = sample, math.floor(sample / 2)
      else
        local err = sample - delay
        delay = delay + math.floor(err / DELAY_GAIN_PARTS)
        jitter = jitter + math.floor((math.abs(err) - jitter) / JITTER_GAIN_PARTS)
      end
      learnt = {string.format('%.0f', delay), string.format('%.0f', jitter)}  -- (every path on writes it back)
    end
  end
  -- Room for it beside the others out (its own units no longer are)?
  local beside = out_per_rate((phase ~= 'g' and not in_line) and units or nil)
  local held = concurrency == 0 or redis.call('ZSCORE', slots_key, ticket) or redis.call('ZSCORE', slots_key, holder)
  local x = nil
  if not_before == 0 and (held or slot_free()) then x = earliest(now, units, beside) end
  if x ~= nil and x - now <= early then
    -- (Granted a start ahead, its process wakes for it: it may start GRANT_SLACKS slacks
    -- after it, a slack for the wake-up and one for the body.)
    local latest = x + (x == now and slack or GRANT_SLACKS * slack)
    come_in(ticket, m)
    record(x, latest, units)
    use(ticket, holder)
    local held_now = hold(holder, x + slot_lease, ticket)
    if x == now then
      forget(ticket)
    else  -- granted: it starts at x, after the caller's wait
      write_back()  -- (a state written first now has its epoch)
      m[M.PHASE], m[M.START], m[M.LATEST], m[M.EPOCH] = 'g', x, latest, tonumber(epoch or '0')
      set_meta(ticket, m)
      redis.call('ZADD', out_key, latest + GRANT_KEEP_MS * 1000, ticket)
      out_count = out_count + 1
    end
    release_heads(a.batch)
    return finish(x == now and RUN or RUN_AT, x - now, {start_us = x, latest_us = latest, waited_us = waited,
                                                        held = held_now})
  end
  -- No room for it now (less than when it was released: an overrun reported since, a
  -- lower limit, a pause): back to its place, before those who came after it.
  local kept = redis.call('HEXISTS', msgs_key, ticket) == 1
  if not kept and a.message == '' then
    -- (released at publish, nothing kept: the caller calls again with its message; the
    -- windows stay as they were, its granted start with them)
    as_stored()
    return finish(DENIED, x and x - now or 0, {waited_us = waited})
  end
  come_in(ticket, m)
  drop_slots(ticket, holder)
  local place = m[M.PLACE]
  if place == 0 then  -- (released at publish, never in line: before everyone)
    place = front_place()
  end
  join(ticket, m, place, not kept and a.message or nil)
  release_heads(a.batch)
  return finish(QUEUED, wait_of(units), {waited_us = waited})
end

-- The reply of a call that costs more than a rate's limit (its operations check it first).
local function too_costly_call()
  for _, r in ipairs(rates) do
    if r.cost > r.limit then return reply({code = TOO_COSTLY, epoch = 0, lead_us = -1}) end
  end
  return nil
end
