-- The index of keys with a line: state key -> when it next needs a look (µs, Redis clock).
-- Every worker's releaser claims the keys that are due, runs the line's 'release' on each
-- (window.lua with line.lua: another slot of a Redis Cluster, so not from here) and settles
-- each with the due time that call answered.
--
-- A claim sets the key's score to a token (a time a claim lease ahead, distinct per key of
-- one claim), so that no other releaser takes it meanwhile. A settle writes the due time
-- only if the score is still that token; if anything wrote the key since (a task joined
-- a line that was empty, an event woke it), its score stays, or is lowered to the due time
-- (ZADD LT): a wake-up is never lost, and a look that comes early only finds nothing to do.
-- A line's own call tells the index (note) when its due time moved earlier or the line
-- began; a line that began writes its score whatever it holds (a claim's token included).
--
-- KEYS[1]  sorted set: state key -> due (µs)
-- ARGV[1]  now in microseconds, or '' to read the Redis server clock (tests only)
-- ARGV[2]  op: 'claim' | 'settle' | 'note'
--   claim  ARGV[3] look-ahead (µs): keys due before now + it; ARGV[4] at most this many;
--          ARGV[5] claim lease (µs). Returns {now, the earliest due left (-1: none), key,
--          token, key, token, ...}
--   settle ARGV[3..] key, token, due per key (due 0: nothing waits, it leaves the index).
--          Returns {now, the earliest due now (-1: none), how many were settled as claimed}
--   note   ARGV[3] key, ARGV[4] due, ARGV[5] '1' (only if earlier) or '2' (whatever the
--          score). Returns 1.
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local index, op = KEYS[1], ARGV[2]

if op == 'claim' then
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
  local settled = 0
  for i = 3, #ARGV - 2, 3 do
    local name, token, due = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local score = tonumber(redis.call('ZSCORE', index, name) or '')
    if score == token then
      settled = settled + 1
      if due == 0 then
        redis.call('ZREM', index, name)
      else
        redis.call('ZADD', index, due, name)
      end
    elseif due > 0 then
      redis.call('ZADD', index, 'LT', due, name)
    end
  end
  local first = redis.call('ZRANGEBYSCORE', index, '-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return {now, first[2] and tonumber(first[2]) or -1, settled}
elseif op == 'note' then
  if ARGV[5] == '2' then
    redis.call('ZADD', index, tonumber(ARGV[4]), ARGV[3])
  else
    redis.call('ZADD', index, 'LT', tonumber(ARGV[4]), ARGV[3])
  end
  return 1
end
return redis.error_reply('index.lua: unknown op ' .. tostring(op))
