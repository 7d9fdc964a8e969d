-- Moves parked ids from one set back to the due set, to be handed out at a given time.
--
-- KEYS[1]  the sorted set they are in: in flight (a release that failed, retried after a
--          backoff) or dead letters (requeued by hand)
-- KEYS[2]  sorted set of parked ids by due time (µs)
-- KEYS[3]  hash: parked id -> times it was handed out
-- ARGV[1]  due time (µs)
-- ARGV[2]  '1' to forget how often they were handed out (a requeue by hand), '0' not to
-- ARGV[3..] the ids
-- Returns how many were moved.
local n = 0
for i = 3, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i])
    if ARGV[2] == '1' then redis.call('HDEL', KEYS[3], ARGV[i]) end
    n = n + 1
  end
end
return n
