-- CUBIC, the adaptive law (core/adapt.py is its twin: tests/script/test_adapt_script.py holds
-- the two to each other). A level is a share of the declared rates, from the law's floor to
-- 1; a pushback leaves a level w_max at a time `at` (µs), and `t` windows after it the level
-- is w_max * (1 + growth * (t - k)^3), k the windows it takes to climb back to w_max.

-- The law (floor, decrease, growth) of its text 'floor,decrease,growth'; nil if unreadable.
local function cubic_law(text)
  local floor_, decrease, growth = string.match(text, '^([^,]+),([^,]+),([^,]+)$')
  floor_, decrease, growth = tonumber(floor_), tonumber(decrease), tonumber(growth)
  if floor_ and decrease and growth then return floor_, decrease, growth end
  return nil
end

-- (w_max, at) of a key's last pushback as its hash keeps it ('A': 'w_max,at,reason'); nil
-- if unreadable.
local function cubic_pushback(kept)
  if not kept then return nil end
  local w_max, at = string.match(kept, '^([^,]+),(%d+)')
  w_max, at = tonumber(w_max), tonumber(at)
  if w_max and at then return w_max, at end
  return nil
end

local function cubic_k(decrease, growth)
  return ((1.0 - decrease) / growth) ^ (1.0 / 3.0)
end

-- The level `t` windows after a pushback to `w_max`.
local function cubic_level(w_max, t, floor_, decrease, growth)
  w_max = math.max(w_max, floor_)
  return math.min(1.0, math.max(floor_, w_max * (1.0 + growth * (t - cubic_k(decrease, growth)) ^ 3)))
end

-- The windows a level pushed back to `level` takes to climb back to the ceiling.
local function cubic_full(level, decrease, growth)
  return cubic_k(decrease, growth) + ((1.0 / level - 1.0) / growth) ^ (1.0 / 3.0)
end
