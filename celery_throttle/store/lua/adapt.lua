-- Lowers an adaptive throttle's limit: its downstream pushed back (a task raised Backoff).
-- The level the key keeps is its last pushback's, 'A' in its state hash: the level then
-- (CUBIC's w_max, a share of the declared rates) and when; window.lua computes the level
-- in force from it at every check, on the store's clock, so every worker obeys a
-- lowering from its next check on. Once per window of the rates: the calls one pushback
-- refused together, on every worker, lower it once. A pushback that comes while the level
-- is still climbing back to the last one's takes w_max itself down too (CUBIC's fast
-- convergence). The sums are core/adapt.py's (level, pushed_level), and window.lua's.
--
-- KEYS[1]  the key's state hash (window.lua's KEYS[1])
-- ARGV[1]  now in microseconds, or '' to read the Redis server clock (tests only)
-- ARGV[2]  the law: floor, decrease, growth ('0.1,0.7,0.005')
-- ARGV[3]  the shortest window of the rates (µs): the law's unit of time, and the guard
-- ARGV[4]  why (a word: backoff)
-- ARGV[5]  the share of the ceiling the key's own starts fill in the window now (the
--          downstream refused with those in: it takes no more)
-- ARGV[6]  the share of the ceiling one refused call is
-- Within the window of a pushback, each further one refines it instead: the refused calls
-- of the window are counted ('Ar', a share of the ceiling), and w_max comes down to what
-- the downstream took of the window (the starts less the refused), if that is lower.
-- Returns {the level in force before, after (as '%.6f' text), 1 if this call lowered it}.
-- include: clock, cubic
local now = clock_now(ARGV[1])
local floor_, decrease, growth = cubic_law(ARGV[2])
local window = math.max(tonumber(ARGV[3]), 1)

local function level_at(w_max, at, x)
  if w_max == nil then return 1.0 end
  return cubic_level(w_max, math.max(x - at, 0) / window, floor_, decrease, growth)
end

local w_max, at = cubic_pushback(redis.call('HGET', KEYS[1], 'A'))
local before = level_at(w_max, at, now)
local used, unit = tonumber(ARGV[5]), tonumber(ARGV[6])
if at ~= nil and now - at < window then
  local refused = (tonumber(redis.call('HGET', KEYS[1], 'Ar') or '0') or 0) + unit
  redis.call('HSET', KEYS[1], 'Ar', string.format('%.6f', refused))
  local took = math.max(floor_, used - refused)
  if took < w_max then
    redis.call('HSET', KEYS[1], 'A', string.format('%.6f', took) .. ',' .. string.format('%.0f', at) .. ',' .. ARGV[4])
    return {string.format('%.6f', before), string.format('%.6f', level_at(took, at, now)), 0}
  end
  return {string.format('%.6f', before), string.format('%.6f', before), 0}
end
local pushed
if w_max ~= nil and before < math.max(w_max, floor_) then
  pushed = decrease * before
else  -- (probing: the level of a window earlier, the last the downstream took)
  pushed = math.min(before, level_at(w_max, at, now - window))
end
pushed = math.max(floor_, math.min(pushed, used))
local value = string.format('%.6f', pushed)
redis.call('HSET', KEYS[1], 'A', value .. ',' .. string.format('%.0f', now) .. ',' .. ARGV[4],
           'Ar', string.format('%.6f', unit))
-- (Kept until the level is back at the ceiling: a hash that outlives its counts keeps it.)
local full = cubic_full(tonumber(value), decrease, growth)
local ttl = math.ceil(full * window / 1000) + 1000
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
return {string.format('%.6f', before), string.format('%.6f', level_at(tonumber(value), now, now)), 1}
