-- Pauses what one control field names, or forgets pauses that are over, and stamps the
-- hash either way: two operators (or two Backoffs) pausing together cannot lose the longer
-- pause, and every process sees by the stamp alone (one HGET) whether to read the hash.
--
-- KEYS[1]  the controls hash: field -> end of a pause (µs, Redis clock) or a live limit;
--          field '~stamp' -> a count every write of the hash adds one to
-- ARGV[1]  now in microseconds, or '' to read the Redis server clock (tests only)
-- ARGV[2]  the pause's field, or '' to prune: then ARGV[5..] name pause fields a reader
--          saw over (at most controls.PRUNE_BATCH), each deleted only if still over
-- ARGV[3]  its length (µs), or '' for no end (ARGV[4])
-- ARGV[4]  the end of a pause with no end (controls.FOREVER_US)
-- Returns the pause's end: this one's, or a longer one already set, which stays; when
-- pruning, how many fields it deleted.
-- The work is bounded by what the call names, never by the size of the hash: 50 000
-- per-key pauses (a Backoff per tenant) cost a pause what one costs.
-- include: clock
local now = clock_now(ARGV[1])
local STAMP = '~stamp'
if ARGV[2] == '' then
  local over = {}
  for i = 5, #ARGV do
    local field = ARGV[i]
    local value = redis.call('HGET', KEYS[1], field)
    -- Only pauses: a live concurrency limit's value ("4") is all digits too.
    if string.sub(field, 1, 6) == 'pause:' and value and string.match(value, '^%d+$') and tonumber(value) < now then
      over[#over + 1] = field
    end
  end
  if #over == 0 then return 0 end
  redis.call('HDEL', KEYS[1], unpack(over))
  redis.call('HINCRBY', KEYS[1], STAMP, 1)
  return #over
end
local until_ = ARGV[3] == '' and tonumber(ARGV[4]) or now + tonumber(ARGV[3])
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[2]) or '')
if current ~= nil and current > until_ then return current end
redis.call('HSET', KEYS[1], ARGV[2], string.format('%.0f', until_))
redis.call('HINCRBY', KEYS[1], STAMP, 1)
return until_
