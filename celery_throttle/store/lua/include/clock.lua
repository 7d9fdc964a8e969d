-- The time of a call, µs: `given` (ARGV[1]: a test clock's) unless '', else the Redis
-- server's clock (TIME): every worker reads one clock, whatever its own says.
local function clock_now(given)
  if given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
