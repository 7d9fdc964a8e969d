-- The index of keys with a line: state key -> when it next needs a look (µs, Redis clock).
-- Every worker's releaser claims the keys that are due, runs the line's 'release' on each
-- (window.lua with line.lua: another slot of a Redis Cluster, so not from here) and settles
-- each with the due time that call answered.
--
-- A claim sets the key's score to a token (a time a claim lease ahead, distinct per key of
-- one claim), so that no other releaser takes it meanwhile. Every due time written comes
-- with the time it was computed at (the line's script's now), kept per key in KEYS[2]:
-- the newest computation wins, whatever the order the writes arrive in (a settle, a note
-- of a call on the line, a wake-up), since each is computed from the whole line at once.
-- A write older than the one the key holds changes nothing, so a line that began, or was
-- woken, while a releaser held its claim keeps its due time, and a wake-up is never lost.
-- A wake-up (a resume, a raised limit: the controls changed) is kept per key too: a due
-- time computed under controls read before it (a releaser, or a call, whose process had
-- not read the change yet: the pause still on, the old limit) may bring the key's look
-- earlier, never later: it leaves the key due now instead, for a look under the controls
-- as they are (it used to win, as newer, and the tasks a resume freed waited out the pause).
--
-- KEYS[1]  sorted set: state key -> due (µs)
-- KEYS[2]  hash: state key -> when the due time it holds was computed (µs)
-- ARGV[1]  now in microseconds, or '' to read the Redis server clock (tests only)
-- ARGV[2]  op: 'claim' | 'settle' | 'note' | 'wake'
--   claim  ARGV[3] look-ahead (µs): keys due before now + it; ARGV[4] at most this many;
--          ARGV[5] claim lease (µs); ARGV[6..] keys of the claimer's last round to settle
--          first, as settle's. Returns {now, the earliest due left (-1: none), key, token,
--          key, token, ...}
--   settle ARGV[3..] key, token, due, computed at, controls read at (0: unknown), per key
--          (due 0: nothing waits, it leaves the index). Returns {now, the earliest due now
--          (-1: none), how many were written}
--   note   ARGV[3] key, ARGV[4] due, ARGV[5] computed at, ARGV[6] controls read at (0:
--          unknown). Returns 1 if written.
--   wake   ARGV[3..] keys: each one held is due now (never later than it was).
--          Returns how many.
-- include: clock
local now = clock_now(ARGV[1])
local index, op = KEYS[1], ARGV[2]

-- Whether a due time of key `name` computed under controls read at `read` (µs; 0: unknown)
-- came before the key's last wake-up.
local function stale(name, read)
  if not read or read == 0 then return false end
  return read < (tonumber(redis.call('HGET', KEYS[2], name .. '#w') or '') or 0)
end

-- Settle the keys of ARGV[from..], five values each (see 'settle'); returns how many were
-- written.
local function settle(from)
  local settled = 0
  for i = from, #ARGV - 4, 5 do
    local name, due, at, read = ARGV[i], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    if stale(name, read) and (due == 0 or due > now) then
      due = now  -- (computed before the last wake-up's news: looked at again now)
    end
    if at >= (tonumber(redis.call('HGET', KEYS[2], name) or '') or 0) then
      settled = settled + 1
      if due == 0 then
        redis.call('ZREM', index, name)
        redis.call('HDEL', KEYS[2], name, name .. '#w')
      else
        redis.call('ZADD', index, due, name)
        redis.call('HSET', KEYS[2], name, string.format('%.0f', at))
      end
    end
  end
  return settled
end

if op == 'claim' then
  settle(6)
  local lease = tonumber(ARGV[5])
  local due = redis.call('ZRANGEBYSCORE', index, '-inf', now + tonumber(ARGV[3]), 'LIMIT', 0, tonumber(ARGV[4]))
  local out = {now, -1}
  for i, name in ipairs(due) do
    local token = now + lease + i
    redis.call('ZADD', index, token, name)
    out[#out + 1] = name
    out[#out + 1] = token
  end
  local first = redis.call('ZRANGEBYSCORE', index, '-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if first[2] then out[2] = tonumber(first[2]) end
  return out
elseif op == 'settle' then
  local settled = settle(3)
  local first = redis.call('ZRANGEBYSCORE', index, '-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return {now, first[2] and tonumber(first[2]) or -1, settled}
elseif op == 'note' then
  local name, due, at = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
  if at < (tonumber(redis.call('HGET', KEYS[2], name) or '') or 0) then return 0 end
  if stale(name, tonumber(ARGV[6] or '0')) then
    local held = redis.call('ZSCORE', index, name)
    if held and due > tonumber(held) then return 0 end  -- (earlier, never later)
  end
  redis.call('ZADD', index, due, name)
  redis.call('HSET', KEYS[2], name, string.format('%.0f', at))
  return 1
elseif op == 'wake' then
  local woken = 0
  for i = 3, #ARGV do
    if redis.call('ZSCORE', index, ARGV[i]) then
      redis.call('ZADD', index, 'LT', now, ARGV[i])
      redis.call('HSET', KEYS[2], ARGV[i], string.format('%.0f', now), ARGV[i] .. '#w', string.format('%.0f', now))
      woken = woken + 1
    end
  end
  return woken
end
return redis.error_reply('index.lua: unknown op ' .. tostring(op))
