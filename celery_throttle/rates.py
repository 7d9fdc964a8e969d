"""Rate strings: ``"10/s"``, ``"1000/h"``, ``"5/10s"``, ``"100/5m"``."""

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
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([a-z]+)\s*$")
_MAX_PERIOD = 10_000 * 86400  # beyond that a float period stops being exact
ACCEPTED = (
    'a count and a period such as "10/s", "100/m", "1000/h", "5000/d", '
    'or a number of units such as "5/10s", "100/5m" (units: ms, s, m, h, d)'
)


@dataclass(frozen=True, order=True)
class Rate:
    """At most ``limit`` units per ``period`` seconds."""

    limit: int
    period: float

    @property
    def period_us(self) -> int:
        return round(self.period * 1_000_000)

    def __str__(self) -> str:
        us = self.period_us
        for name, unit_us in (("d", 86400_000_000), ("h", 3600_000_000), ("m", 60_000_000), ("s", 1_000_000)):
            if us >= unit_us and us % unit_us == 0:
                count = us // unit_us
                return f"{self.limit}/{count if count != 1 else ''}{name}"
        if us >= 1_000_000:  # (a window with a margin: 10/1.02s)
            return f"{self.limit}/{f'{us / 1e6:.6f}'.rstrip('0').rstrip('.')}s"
        return f"{self.limit}/{us // 1000 if us % 1000 == 0 else us / 1000}ms"


def parse_rate(text: str | Rate) -> Rate:
    """Parse one rate string, raising :class:`ConfigurationError` on anything else."""
    if isinstance(text, Rate):
        return text
    if not isinstance(text, str):
        raise ConfigurationError(f"rate must be a string, got {text!r}; use {ACCEPTED}")
    match = _RATE.match(text.lower())
    if not match or match.group(3) not in _UNITS:
        raise ConfigurationError(f"bad rate {text!r}: use {ACCEPTED}")
    limit = int(match.group(1))
    period = float(match.group(2) or 1) * _UNITS[match.group(3)]
    if limit <= 0 or not 0.001 <= period <= _MAX_PERIOD:
        raise ConfigurationError(
            f"bad rate {text!r}: the count must be at least 1 and the period between 1ms and 10000d"
        )
    return Rate(limit, period)


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
