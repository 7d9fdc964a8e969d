-- renew: [P..] holders whose slot leases go on
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

local function renew()
  for i = P, #ARGV do
    local holder = ARGV[i]
    local until_ = any_slots() and redis.call('ZSCORE', slots_key, holder)
    if until_ and tonumber(until_) > now then
      redis.call('ZADD', slots_key, now + slot_lease, holder)
    else
      drop_slots(holder)
      report(holder, false, 'l')
    end
  end
  return finish(#reported > 0 and LOST or RUN, 0)
end

return renew()
