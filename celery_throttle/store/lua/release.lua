-- Hands parked messages that are due (or nearly) to one releasing worker.
--
-- Each one moves to the in-flight set under a lease: the worker that got it publishes it
-- and then acks (ack.lua). If that worker dies first, the lease runs out and the message
-- is handed out again, so nothing parked is lost. A message is never handed to two
-- workers at once: this script is atomic.
--
-- KEYS[1]  sorted set of parked ids by due time (µs)
-- KEYS[2]  hash: parked id -> serialized message
-- KEYS[3]  sorted set of in-flight ids by lease expiry (µs)
-- KEYS[4]  hash: parked id -> times it was handed out
-- KEYS[5]  sorted set of ids given up on (dead letters), by when
-- ARGV[1]  now (µs) or '' for the Redis clock (tests only)
-- ARGV[2]  look-ahead (µs): release what is due before now + look-ahead
-- ARGV[3]  at most this many messages
-- ARGV[4]  lease (µs)
-- ARGV[5]  attempts: a message handed out this many times already (each time it could not
--          be sent back, or its worker died with it) is a dead letter instead; its message
--          stays, for the CLI to list, requeue or drop
-- Returns {now, id1, due1, message1, id2, due2, message2, ...}; a due id whose message
-- is gone (evicted, or deleted by hand) becomes a dead letter and comes back with no
-- message (nil), for the worker to log and count: nothing vanishes without a word.
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local limit, lease, attempts = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])

-- Leases that ran out: their worker died between taking and publishing. Due now.
local lost = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, limit)
for _, id in ipairs(lost) do
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZADD', KEYS[1], now, id)
end

local out = {now}
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + tonumber(ARGV[2]),
                       'WITHSCORES', 'LIMIT', 0, limit)
for i = 1, #due, 2 do
  local id = due[i]
  redis.call('ZREM', KEYS[1], id)
  local message = redis.call('HGET', KEYS[2], id)
  if message and tonumber(redis.call('HGET', KEYS[4], id) or '0') >= attempts then
    redis.call('ZADD', KEYS[5], now, id)
  elseif message then
    redis.call('HINCRBY', KEYS[4], id, 1)
    redis.call('ZADD', KEYS[3], now + lease, id)
    out[#out + 1] = id
    out[#out + 1] = due[i + 1]
    out[#out + 1] = message
  else
    redis.call('ZADD', KEYS[5], now, id)
    out[#out + 1] = id
    out[#out + 1] = due[i + 1]
    out[#out + 1] = false  -- (a nil reply: an empty message is still a message)
  end
end
return out
