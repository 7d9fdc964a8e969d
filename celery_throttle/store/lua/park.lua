-- Parks a task whose wait is long: its message lives in Redis, not in a worker's memory.
--
-- KEYS[1]  sorted set of parked ids, scored by due time (µs)
-- KEYS[2]  hash: parked id -> serialized message
-- ARGV[1]  parked id (unique per parking)
-- ARGV[2]  due time (µs, Redis clock)
-- ARGV[3]  serialized message
-- Returns the number of parked messages.
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return redis.call('ZCARD', KEYS[1])
