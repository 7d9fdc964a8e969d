"""Limits that learn the downstream: a throttle declared with ``adapt`` takes its rates as
a ceiling, and the limit in force moves between a floor and that ceiling, shared by every
worker: lowered when the downstream pushes back (a task raises ``Backoff``: a 429, a 503,
a ``Retry-After``), raised again as time passes without pushback.

The rise is TCP CUBIC's (RFC 8312) in windows of the rate rather than seconds, and
relative to the level of the last pushback, ``w_max``, rather than in packets: the level is
``decrease * w_max`` right after it, and at ``t`` windows after it

    level(t) = w_max * (1 + growth * (t - K)**3),   K = cbrt((1 - decrease) / growth)

so it climbs back fast, slows as it nears ``w_max`` (where the downstream pushed back last:
it dwells there, rather than oscillating into bursts of refusals), then probes beyond it,
slowly at first and faster the longer nothing pushes back (a downstream whose limit rose
is found within a few windows). Relative, so that it dwells as many windows at 5 % of
the ceiling as at 80 %. A pushback is counted once per window of the rate (several calls
refused together are one pushback); one that comes while the level is still climbing
back (the downstream refused it below ``w_max``: its limit fell) takes ``w_max`` itself
down too (CUBIC's fast convergence), so that a downstream whose limit fell far is met
within a few windows. The state is the level of the last pushback and its moment (the
store's clock), in the control hash; every process computes the level from them, so
there is nothing to count per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from .errors import ConfigurationError
from .options import option_of

__all__ = ["Adapt", "Pushback", "adapt_of", "level", "pushed_level", "refined_level", "scaled_limit"]


@dataclass(frozen=True)
class Adapt:
    """How an adaptive throttle moves: its ``floor``, a share of the ceiling (its declared
    rates); each ``decrease``, a share of the level in force; CUBIC's ``growth``, a share
    of the last pushback's level per window cubed. The defaults: never below a tenth of the
    ceiling; a pushback takes 30 % off (TCP CUBIC's 0.7); back at the last pushback's level
    about 4 windows after it, 1.5 times that level about 9 windows after it. On the model of
    tests/pure/test_adapt.py (a downstream whose limit moves, a tenth of a window of calls in
    flight when it refuses): 0.65 refusals per 100 calls and 95 % of what the downstream
    allows used over random moves (0.44 and 96 % with a growth of 0.001, 15 % off). Against
    bench section 16's API (50/s, 20/s, then 80/s, on real workers) a growth of 0.001 took
    14.6 s to climb back to 90 % of 80/s and 1.18 of the oracle's makespan (1.2 refusals per
    100); these defaults 6.6 s, 1.13 (1.4 per 100)."""

    floor: float = 0.1
    decrease: float = 0.7
    growth: float = 0.005

    def __post_init__(self) -> None:
        for name, low, high in (("floor", 0.0, 1.0), ("decrease", 0.0, 1.0), ("growth", 0.0, 100.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
                raise ConfigurationError(f"adapt {name} must be a number in ({low:g}, {high:g}], got {value!r}")
        if self.decrease == 1.0:
            raise ConfigurationError("adapt decrease must be below 1: a pushback must lower the limit")


def adapt_of(value: Any) -> Adapt | None:
    """``adapt=`` as declared: True (the defaults), an :class:`Adapt`, a dict of its fields
    (rules), or None/False (not adaptive)."""
    return option_of(value, Adapt, "adapt")


class Pushback(NamedTuple):
    """The last pushback of an adaptive scope or key: the level in force then (``w_max``,
    a share of the ceiling), when (µs, the store's clock), and why."""

    w_max: float
    at_us: int
    reason: str

    def value(self) -> str:
        """As the control hash keeps it."""
        return f"{self.w_max:.6f},{self.at_us},{self.reason}"

    @classmethod
    def read(cls, raw: str) -> Pushback:
        """From the control hash; ValueError for anything else."""
        w_max, at, reason = raw.split(",", 2)
        pushed = cls(float(w_max), int(at), reason)
        if not (0.0 < pushed.w_max <= 1.0 and pushed.at_us >= 0) or math.isnan(pushed.w_max):
            raise ValueError(f"not an adaptive level: {raw!r}")
        return pushed


def level(adapt: Adapt, pushback: Pushback | None, now_us: int, window_us: int) -> float:
    """The share of the ceiling in force at ``now_us`` (1.0 without a pushback)."""
    if pushback is None:
        return 1.0
    w_max = max(pushback.w_max, adapt.floor)
    t = max(now_us - pushback.at_us, 0) / max(window_us, 1)
    k = ((1.0 - adapt.decrease) / adapt.growth) ** (1.0 / 3.0)
    return min(1.0, max(adapt.floor, w_max * (1.0 + adapt.growth * (t - k) ** 3)))


def pushed_level(adapt: Adapt, last: Pushback | None, now: float, before: float, used: float = 1.0) -> float:
    """The ``w_max`` a pushback keeps when the level in force is ``now``, was ``before`` a
    window earlier, and the window holds ``used`` (a share of the ceiling) of the key's
    starts: while the level is still climbing back to the last pushback's (the downstream
    refused below it), ``decrease * now`` (CUBIC's fast convergence); else the level of a
    window earlier, the last the downstream took (a probe climbs by whole windows, and
    ``now`` is already past what it takes). Never more than ``used``: the downstream
    refused with that many of ours in its window, so it takes no more (a ceiling four
    times the downstream's limit is met in a window or two, not in ten decreases)."""
    if last is not None and now < max(last.w_max, adapt.floor):
        pushed = adapt.decrease * now
    else:
        pushed = min(now, before)
    return max(adapt.floor, min(pushed, used))


def refined_level(adapt: Adapt, w_max: float, used: float, refused: float) -> float | None:
    """A further pushback within the window of the last: the ``w_max`` it refines, the
    share of the ceiling the key's starts fill (``used``) less those refused in the window
    (``refused``, this one's included), when that is lower (the downstream took no more of
    the window); None when it is not."""
    took = max(adapt.floor, used - refused)
    return took if took < w_max else None


def scaled_limit(limit: int, share: float, least: int = 1) -> int:
    """A rate's limit at ``share`` of it: at least ``least`` (a call's own units: a call
    that can never fit would never start), at most the limit."""
    return min(limit, max(least, math.floor(limit * share)))
