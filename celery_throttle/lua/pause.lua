-- Pauses what one control field names, and forgets the pauses that are over, at once: two
-- operators (or two Backoffs) pausing together cannot lose the longer pause, and the hash
-- every worker reads stays small.
--
-- KEYS[1]  the controls hash: field -> end of a pause (µs, Redis clock) or a live limit
-- ARGV[1]  now in microseconds, or '' to read the Redis server clock (tests only)
-- ARGV[2]  the pause's field
-- ARGV[3]  its length (µs), or '' for no end (ARGV[4])
-- ARGV[4]  the end of a pause with no end (controls.FOREVER_US)
-- Returns the pause's end: this one's, or a longer one already set, which stays.
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local until_ = ARGV[3] == '' and tonumber(ARGV[4]) or now + tonumber(ARGV[3])
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[2]) or '')
if current ~= nil and current > until_ then return current end
redis.call('HSET', KEYS[1], ARGV[2], string.format('%.0f', until_))
-- Only pauses are pruned: a live concurrency limit's value ("4") is all digits too.
local fields, over = redis.call('HGETALL', KEYS[1]), {}
for i = 1, #fields, 2 do
  local value = fields[i + 1]
  if string.sub(fields[i], 1, 6) == 'pause:' and string.match(value, '^%d+$') and tonumber(value) < now then
    over[#over + 1] = fields[i]
  end
end
if #over > 0 then redis.call('HDEL', KEYS[1], unpack(over)) end
return until_
