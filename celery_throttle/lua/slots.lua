-- Concurrency slots of one (scope, key): at most `limit` holders at once, each a lease that
-- its worker renews while the body runs, and a FIFO of the tasks waiting for a slot, whose
-- messages wait here too. One script, so that taking, waiting, releasing and handing a
-- slot over are each atomic; every key shares the state hash's hash tag.
--
-- A holder is a task id. A slot that frees goes to the task at the head of the queue (it
-- is handed over: the slot is held in its name, and its message comes back in the reply,
-- for the caller to send to the broker), so that a fresh arrival cannot take it first and
-- the woken task cannot be denied again: no herd, no polling. A lease that ran out (its
-- worker died, or a handed-over task never arrived) is reclaimed by the next call on the
-- key, or by a worker's sweep; a handed-over task that never arrived goes back to the head
-- of the queue, its message kept.
--
-- KEYS[1]  sorted set: holder -> end of its lease (µs, Redis clock)
-- KEYS[2]  sorted set: waiting task -> when it first waited (µs): the queue, FIFO
-- KEYS[3]  hash: waiting (or handed-over) task -> its serialized message
-- ARGV[1]  now in microseconds, or '' to read the Redis server clock (tests only)
-- ARGV[2]  op: 'take' | 'enqueue' | 'release' | 'renew' | 'sweep' | 'peek' ('enqueue', at
--          publish: queue the task if it would wait, take nothing if it would not)
-- ARGV[3]  limit: how many may hold a slot at once
-- ARGV[4]  lease (µs): how long a slot stays held without a renewal
-- ARGV[5]  the holder (task id); for 'renew': the first of the holders, ARGV[5..]
-- ARGV[6]  for 'take' and 'enqueue': the task's message, or '' (not given: a task that
--          finds no slot is told FULL, nothing written; given: it is queued)
-- ARGV[7]  for 'take': when the task first waited (µs), or 0: now. A task queued again
--          keeps its place.
--
-- Returns {code, running, waiting, now, woken id 1, message 1, id 2, message 2, ...}:
--   code   'take': TAKEN (the slot is the holder's), FULL (none free, not queued),
--          QUEUED (none free, queued with its message)
--          'enqueue': FREE (a slot is free and nobody waits: nothing written), else as
--          'take' (FULL or QUEUED)
--          'release': TAKEN if the holder held its slot, LOST if its lease had run out
--          'renew': LOST if any of the holders' leases had run out (then their ids follow
--          `now` in place of the woken), else TAKEN
--          'sweep', 'peek': TAKEN
--   running, waiting  slots held and tasks queued, after the call
--   woken  tasks a slot was handed to: the caller sends each message to the broker. An id
--          whose message is gone (evicted) comes with no message (nil): it is dropped
--          from the queue and handed nothing, for the caller to log and count.
local slots, queue, messages = KEYS[1], KEYS[2], KEYS[3]
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local op, limit, lease, holder = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local out = {0, 0, 0, now}

-- Leases that ran out. A holder that was handed its slot and never came keeps its message:
-- it goes back to the head of the queue (score 0), to be woken again.
local function reclaim()
  local expired = redis.call('ZRANGEBYSCORE', slots, '-inf', now)
  if #expired == 0 then return end
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
  for _, id in ipairs(expired) do
    if redis.call('HEXISTS', messages, id) == 1 then redis.call('ZADD', queue, 0, id) end
  end
end

-- Keep the holders' set while a lease in it may still count (empty sets go by themselves).
local function keep()
  if redis.call('EXISTS', slots) == 1 then redis.call('PEXPIRE', slots, math.ceil(2 * lease / 1000) + SLOTS_TTL_PAD_MS) end
end

local function hold(id)
  redis.call('ZADD', slots, now + lease, id)
end

-- Hand each free slot to the head of the queue, but `except` (the caller, who takes its
-- own turn). Returns true if `except` reached the head with a slot free.
local function hand_over(except)
  local free = limit - redis.call('ZCARD', slots)
  while free > 0 do
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if head == nil then return false end
    if head == except then return true end
    redis.call('ZREM', queue, head)
    local message = redis.call('HGET', messages, head)
    out[#out + 1] = head
    if message then
      hold(head)
      free = free - 1
      out[#out + 1] = message
    else
      out[#out + 1] = false  -- (a nil reply)
    end
  end
  return false
end

local function counts(code)
  out[1], out[2], out[3] = code, redis.call('ZCARD', slots), redis.call('ZCARD', queue)
  keep()
  return out
end

local function take()
  reclaim()
  if redis.call('ZSCORE', slots, holder) then
    -- Handed over while it waited (or the same task again: a redelivery): its own.
    hold(holder)
    redis.call('ZREM', queue, holder)
    redis.call('HDEL', messages, holder)
    return counts(TAKEN)
  end
  local at_head = hand_over(holder)
  if at_head or (redis.call('ZCARD', slots) < limit and redis.call('ZCARD', queue) == 0) then
    hold(holder)
    redis.call('ZREM', queue, holder)
    redis.call('HDEL', messages, holder)
    return counts(TAKEN)
  end
  if ARGV[6] == '' then return counts(FULL) end
  local first = tonumber(ARGV[7])
  redis.call('ZADD', queue, 'NX', first > 0 and first or now, holder)
  redis.call('HSET', messages, holder, ARGV[6])
  return counts(QUEUED)
end

local function enqueue()
  reclaim()
  hand_over(nil)
  if redis.call('ZCARD', slots) < limit and redis.call('ZCARD', queue) == 0 then return counts(FREE) end
  if ARGV[6] == '' then return counts(FULL) end
  redis.call('ZADD', queue, 'NX', now, holder)
  redis.call('HSET', messages, holder, ARGV[6])
  return counts(QUEUED)
end

local function release()
  local held = redis.call('ZREM', slots, holder) == 1
  reclaim()
  hand_over(nil)
  return counts(held and TAKEN or LOST)
end

local function renew()
  local lost = {}
  for i = 5, #ARGV do
    local id = ARGV[i]
    if redis.call('ZSCORE', slots, id) and redis.call('ZSCORE', slots, id) + 0 > now then
      hold(id)
    else
      redis.call('ZREM', slots, id)
      lost[#lost + 1] = id
    end
  end
  counts(#lost > 0 and LOST or TAKEN)
  for _, id in ipairs(lost) do out[#out + 1] = id end
  return out
end

local function sweep()
  reclaim()
  hand_over(nil)
  return counts(TAKEN)
end

local function peek()
  out[1] = TAKEN
  out[2] = redis.call('ZCOUNT', slots, '(' .. string.format('%.0f', now), '+inf')
  out[3] = redis.call('ZCARD', queue)
  return out
end

if op == 'take' then return take()
elseif op == 'enqueue' then return enqueue()
elseif op == 'release' then return release()
elseif op == 'renew' then return renew()
elseif op == 'sweep' then return sweep()
elseif op == 'peek' then return peek()
end
return redis.error_reply('slots.lua: unknown op ' .. tostring(op))
