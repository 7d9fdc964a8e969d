"""The baselines users write by hand (from the seed notes), for comparison.

* ``fixed``: the seed's fixed-window counter: INCR a key named after
  ``floor(TIME / window)``, PEXPIRE it on the first hit, deny above the limit.
* ``sliding``: the common sliding log: a ZSET of start timestamps, trimmed with
  ZREMRANGEBYSCORE, counted with ZCARD, appended with ZADD.

Both only add what a Celery user needs to re-send a denied task: how long until the
window opens again (for ``self.retry(countdown=...)``). No reservation, no jitter.
"""

from __future__ import annotations

from typing import Any

# KEYS[1] key base; ARGV[1] limit, ARGV[2] window (ms).
# Returns {allowed (1/0), ms until the current window ends}.
FIXED_LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = math.floor(now / window)
local key = KEYS[1] .. ':' .. w
local current = redis.call('INCR', key)
if current == 1 then
  redis.call('PEXPIRE', key, window)
end
if current > limit then
  return {0, (w + 1) * window - now}
end
return {1, 0}
"""

# KEYS[1] the log (ZSET); ARGV[1] limit, ARGV[2] window (ms), ARGV[3] unique member.
# Returns {allowed (1/0), ms until the oldest entry leaves the window}.
SLIDING_LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], window)
  return {1, 0}
end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, math.ceil(tonumber(oldest[2]) + window - now)}
"""


class NaiveLimiter:
    """One of the hand-written limiters, on one Redis client."""

    def __init__(self, client: Any, algorithm: str) -> None:
        if algorithm not in ("fixed", "sliding"):
            raise ValueError(f"unknown naive algorithm {algorithm!r}")
        self.algorithm = algorithm
        self.script = client.register_script(FIXED_LUA if algorithm == "fixed" else SLIDING_LUA)

    def args(self, limit: int, window_s: float, member: str) -> list[Any]:
        window_ms = round(window_s * 1000)
        return [limit, window_ms] if self.algorithm == "fixed" else [limit, window_ms, member]

    def hit(self, key: str, limit: int, window_s: float, member: str = "") -> tuple[bool, float]:
        """(allowed, seconds until the window opens again)."""
        reply = self.script(keys=[key], args=self.args(limit, window_s, member))
        return bool(int(reply[0])), max(int(reply[1]), 0) / 1000

    def queue(self, pipe: Any, key: str, limit: int, window_s: float, member: str = "") -> None:
        """Queue one hit in a pipeline (for bulk fills)."""
        self.script(keys=[key], args=self.args(limit, window_s, member), client=pipe)
