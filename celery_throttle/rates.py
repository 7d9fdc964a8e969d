"""Rate strings: ``"10/s"``, ``"1000/h"``, ``"5/10s"``, ``"100/5m"``."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
        return int(round(self.period * 1_000_000))

    def __str__(self) -> str:
        for name, seconds in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
            count = self.period / seconds
            if count >= 1 and count == int(count):
                return f"{self.limit}/{int(count) if count != 1 else ''}{name}"
        return f"{self.limit}/{int(self.period * 1000)}ms"


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
    if limit <= 0 or period < 0.001:
        raise ConfigurationError(
            f"bad rate {text!r}: the count must be at least 1 and the period at least 1ms"
        )
    return Rate(limit, period)


def parse_rates(rates: object) -> tuple[Rate, ...]:
    """Parse a rate string or a list of them into a tuple of distinct rates."""
    if isinstance(rates, (str, Rate)):
        rates = [rates]
    if not isinstance(rates, (list, tuple)) or not rates:
        raise ConfigurationError(f"expected a rate or a list of rates, got {rates!r}; use {ACCEPTED}")
    return tuple(sorted(set(parse_rate(r) for r in rates)))
