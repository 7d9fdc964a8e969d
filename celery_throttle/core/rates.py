"""Rate strings: ``"10/s"``, ``"1000/h"``, ``"5/10s"``, ``"100/5m"``, and rates of a named
unit, ``"30000 tokens/m"``: a call counts its ``cost`` of that unit there (see
:class:`Rate`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from .errors import ConfigurationError

__all__ = ["Rate", "parse_rate", "parse_rates"]

_UNITS = {
    "ms": 0.001,
    "s": 1, "sec": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
}
_RATE = re.compile(r"^\s*(\d+)\s*(?:\s([a-z_][a-z0-9_]*)\s*)?/\s*(\d+(?:\.\d+)?)?\s*([a-z]+)\s*$")
#: A unit's name: what a rate such as "30000 tokens/m" counts, and a key of ``cost={...}``.
UNIT_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_MAX_PERIOD = 10_000 * 86400  # beyond that a float period stops being exact
ACCEPTED = (
    'a count and a period such as "10/s", "100/m", "1000/h", "5000/d", '
    'or a number of units such as "5/10s", "100/5m" (periods: ms, s, m, h, d); '
    'a rate that counts a unit of its own names it: "30000 tokens/m"'
)


@dataclass(frozen=True, order=True)
class Rate:
    """At most ``limit`` units per ``period`` seconds.

    ``unit``: what the rate counts, e.g. ``"tokens"`` for ``"30000 tokens/m"``; a call
    counts its cost in that unit there (``cost={"tokens": ...}``). Rates of one throttle
    may count different units (requests and tokens per minute of one API); ``""``, the
    default, is the call's own ``cost``.
    """

    limit: int
    period: float
    unit: str = ""

    @property
    def period_us(self) -> int:
        return round(self.period * 1_000_000)

    def __str__(self) -> str:
        return f"{self.limit} {self.unit}/{self._period()}" if self.unit else f"{self.limit}/{self._period()}"

    def _period(self) -> str:
        us = self.period_us
        for name, unit_us in (("d", 86400_000_000), ("h", 3600_000_000), ("m", 60_000_000), ("s", 1_000_000)):
            if us >= unit_us and us % unit_us == 0:
                count = us // unit_us
                return f"{count if count != 1 else ''}{name}"
        if us >= 1_000_000:  # (a window with a margin: 10/1.02s)
            return f"{f'{us / 1e6:.6f}'.rstrip('0').rstrip('.')}s"
        return f"{us // 1000 if us % 1000 == 0 else us / 1000}ms"


def parse_rate(text: str | Rate) -> Rate:
    """Parse one rate string, raising :class:`ConfigurationError` on anything else."""
    if isinstance(text, Rate):
        return text
    if not isinstance(text, str):
        raise ConfigurationError(f"rate must be a string, got {text!r}; use {ACCEPTED}")
    match = _RATE.match(text.lower())
    if not match or match.group(4) not in _UNITS:
        raise ConfigurationError(f"bad rate {text!r}: use {ACCEPTED}")
    limit = int(match.group(1))
    period = float(match.group(3) or 1) * _UNITS[match.group(4)]
    if limit <= 0 or not 0.001 <= period <= _MAX_PERIOD:
        raise ConfigurationError(
            f"bad rate {text!r}: the count must be at least 1 and the period between 1ms and 10000d"
        )
    return Rate(limit, period, match.group(2) or "")


def parse_rates(rates: object) -> tuple[Rate, ...]:
    """Parse a rate string or a list of them into a tuple of distinct rates."""
    if isinstance(rates, (str, Rate)):
        rates = (rates,)
    if not isinstance(rates, (list, tuple)) or not rates:
        raise ConfigurationError(f"expected a rate or a list of rates, got {rates!r}; use {ACCEPTED}")
    try:
        return _parse_many(tuple(rates))
    except TypeError:  # an unhashable item: parse_rate says what is wrong with it
        return tuple(sorted({parse_rate(r) for r in rates}))


@lru_cache(maxsize=1024)
def _parse_many(rates: tuple[str | Rate, ...]) -> tuple[Rate, ...]:
    # Cached: direct callers and callable per-tenant rates pass the same strings again
    # and again, on the hot path.
    return tuple(sorted({parse_rate(r) for r in rates}))
