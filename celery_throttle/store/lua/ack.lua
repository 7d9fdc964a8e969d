-- Forgets parked messages that their releasing worker has published.
--
-- KEYS[1]  sorted set of in-flight ids (see release.lua)
-- KEYS[2]  hash: parked id -> serialized message
-- KEYS[3]  hash: parked id -> times it was handed out
-- ARGV     the published ids
-- Returns how many were still in flight.
local n = 0
for i = 1, #ARGV, 500 do
  local ids = {unpack(ARGV, i, math.min(i + 499, #ARGV))}
  n = n + redis.call('ZREM', KEYS[1], unpack(ids))
  redis.call('HDEL', KEYS[2], unpack(ids))
  redis.call('HDEL', KEYS[3], unpack(ids))
end
return n
