-- drop: an operator deletes tasks waiting in the line (they never run). [P..] entries
-- (One script: the loader puts window.lua and line.lua before it, each function this file
-- reaches kept; window.lua's header says what the keys, the arguments and the replies are,
-- line.lua's what the line holds.)

-- An operator deletes tasks waiting in the line: they never run (one released meanwhile
-- goes on). Reported back as 'l' with their task id.
local function drop()
  for i = P, #ARGV do
    local id = ARGV[i]
    if redis.call('ZSCORE', line_key, id) then
      local m = meta_of(id)
      leave(id, m)
      forget(id)
      report(id, m and m[M.TASK] or id, 'd')
    end
  end
  return finish(RUN, 0)
end

return drop()
