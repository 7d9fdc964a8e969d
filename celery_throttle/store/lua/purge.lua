-- Deletes parked messages that are still waiting (not taken by a releaser meanwhile).
--
-- KEYS[1]  sorted set of parked ids by due time
-- KEYS[2]  hash: parked id -> serialized message
-- KEYS[3]  hash: parked id -> release attempts
-- ARGV     the parked ids
-- Returns how many were deleted.
local gone = 0
for _, id in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[1], id) == 1 then
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    gone = gone + 1
  end
end
return gone
