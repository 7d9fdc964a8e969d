"""Pure-Python twins of the window algorithms, and a plain truth checker.

``SlidingRate`` and ``FixedRate`` do what ``sliding.lua`` and ``fixed.lua`` do to one
rate's state (load, usage, earliest, record, unrecord, fold, and the stored encoding),
under the same layout (``celery_throttle.core.state.StateLayout``): same state, same
arithmetic (the Lua numbers are doubles; every time here stays below 2**53, where Python
ints and Lua doubles agree, and divisions are written as float divisions like the Lua's).
``tests/line_reference.py`` builds the twin of the whole script on them.

The truth checker knows nothing of buckets: given the (start time, units) of every call
that actually started, it measures the most units in any half-open interval of one
period (sliding) or in any aligned window (fixed).

Times are integer microseconds throughout.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass
from io import BytesIO

import msgpack

from celery_throttle.core.state import STATE_LAYOUT, StateLayout

__all__ = [
    "BUCKETS",
    "FixedRate",
    "SlidingRate",
    "max_units_in_any_interval",
    "max_units_per_aligned_window",
]

#: Buckets per period of a sliding window, as the scripts are loaded with it by default
#: (state.StateLayout says what each constant of the layout is; a model built with
#: another layout uses that one).
BUCKETS = STATE_LAYOUT.buckets


# -- sliding ------------------------------------------------------------------------------


@dataclass
class Bucket:
    units: int
    latest: int


class SlidingRate:
    """One rate of a sliding window: buckets keyed by floor(latest / width)."""

    tag = "s"

    def __init__(self, limit: int, period_us: int, layout: StateLayout = STATE_LAYOUT, unit: str = "") -> None:
        self.limit = limit
        self.period = period_us
        self.layout = layout
        self.unit = unit
        self.width = max(math.ceil(period_us / layout.buckets), 1000)
        self.field = f"{self.tag}{limit}/{period_us}" + (f".{unit}" if unit else "")
        self.buckets: dict[int, Bucket] = {}

    def bucket_of(self, latest: int) -> int:
        return math.floor(latest / self.width)

    def load(self, now: int) -> None:
        """What decode() keeps: buckets whose latest start may still count at ``now``."""
        self.buckets = {k: b for k, b in self.buckets.items()
                        if b.units > 0 and b.latest > now - self.period}

    def usage(self, x: int) -> int:
        return sum(b.units for b in self.buckets.values() if b.latest > x - self.period)

    def earliest(self, x: int, cost: int, slack: int = 0) -> int:
        live = [b for b in self.buckets.values() if b.latest > x - self.period]
        used = sum(b.units for b in live)
        if used + cost <= self.limit:
            return x
        for b in sorted(live, key=lambda b: b.latest):
            used -= b.units
            if used + cost <= self.limit:
                return max(x, b.latest + self.period)
        return x + self.period

    def record(self, at: int, latest: int, cost: int) -> int:
        k = self.bucket_of(latest)
        b = self.buckets.get(k)
        if b is None:
            self.buckets[k] = Bucket(cost, latest)
        else:
            b.units += cost
            b.latest = max(b.latest, latest)
        return latest

    def unrecord(self, at: int, grace: int, cost: int) -> bool:
        """Returns whether the bucket is left holding units (written back, not deleted)."""
        k = self.bucket_of(at + grace)
        b = self.buckets.get(k)
        if b is not None:
            b.units -= cost
            if b.units <= 0:
                del self.buckets[k]
        return k in self.buckets

    def clear_at(self) -> int:
        return max((b.latest + self.period for b in self.buckets.values()), default=0)

    def fold(self, now: int) -> None:
        """Folds the first bucket into the next while that one, too, is followed by at
        least ``limit`` units (neither can decide anything), and more while there are
        too many buckets."""
        keys = sorted(self.buckets)
        after = sum(self.buckets[k].units for k in keys[2:])
        i = 0
        while i + 1 < len(keys) and (after >= self.limit or len(keys) - i > self.layout.max_buckets):
            front, behind = self.buckets.pop(keys[i]), self.buckets[keys[i + 1]]
            behind.units += front.units  # and keeps its own latest, the later one
            i += 1
            if i + 1 < len(keys):
                after -= self.buckets[keys[i + 1]].units

    def holds_units(self) -> bool:
        return bool(self.buckets)

    def entries(self) -> list[int]:
        """The stored list: latest, units of each bucket, in bucket order."""
        return [v for k in sorted(self.buckets) for v in (self.buckets[k].latest, self.buckets[k].units)]

    def live(self, stored: list[int], now: int) -> list[int]:
        """What load() keeps of a stored list at ``now``."""
        pairs = zip(stored[::2], stored[1::2])
        return [v for latest, units in pairs if latest > now - self.period for v in (latest, units)]

    @staticmethod
    def decode(value: bytes) -> list[int]:
        """The stored list, from the field's MessagePack stream: the cold buckets' total
        units, the hot (last) bucket's latest and units, then the cold buckets' pairs."""
        values = list(msgpack.Unpacker(BytesIO(value)))
        cold_units, hot_latest, hot_units, *cold = values
        assert cold_units == sum(cold[1::2]), f"cold total {cold_units} is not the sum of {cold}"
        return [*cold, hot_latest, hot_units]


# -- fixed --------------------------------------------------------------------------------


class FixedRate:
    """One rate of a fixed window: units per aligned window k = floor(t / period), and
    (after a deep backlog) a range of windows a..b that counts as full."""

    tag = "f"

    def __init__(self, limit: int, period_us: int, layout: StateLayout = STATE_LAYOUT, unit: str = "") -> None:
        self.limit = limit
        self.period = period_us
        self.layout = layout
        self.unit = unit
        self.field = f"{self.tag}{limit}/{period_us}" + (f".{unit}" if unit else "")
        self.windows: dict[int, int] = {}
        self.full: tuple[int, int] | None = None
        self.current = 0

    def window_of(self, t: int) -> int:
        return math.floor(t / self.period)

    def load(self, now: int) -> None:
        self.current = current = self.window_of(now)
        self.windows = {k: u for k, u in self.windows.items() if u > 0 and k >= current}
        self.full = self._trimmed(self.full, current)

    @staticmethod
    def _trimmed(full: tuple[int, int] | None, current: int) -> tuple[int, int] | None:
        if full is None or full[1] < current:
            return None
        return (max(full[0], current), full[1])

    def in_full(self, k: int) -> bool:
        return self.full is not None and self.full[0] <= k <= self.full[1]

    def units_in(self, k: int) -> int:
        return self.limit if self.in_full(k) else self.windows.get(k, 0)

    def usage(self, x: int) -> int:
        return self.units_in(self.window_of(x))

    def earliest(self, x: int, cost: int, slack: int = 0) -> int:
        k = self.window_of(x)
        while True:
            if self.full is not None and self.in_full(k):
                k = self.full[1] + 1
                continue
            t = max(x, k * self.period)
            # it may start as late as t + slack: every window up to there must have room
            if all(self.units_in(j) + cost <= self.limit for j in range(k, self.window_of(t + slack) + 1)):
                return t
            k += 1

    def _add(self, k: int, units: int) -> None:
        if self.in_full(k) or k < self.current:  # (a window that has passed counts nothing)
            return
        total = self.windows.get(k, 0) + units
        if total > 0:
            self.windows[k] = total
        else:
            self.windows.pop(k, None)

    def record(self, at: int, latest: int, cost: int) -> int:
        """Counts the units in every window [at, latest] touches."""
        for w in range(self.window_of(at), self.window_of(latest) + 1):
            self._add(w, cost)
        return (self.window_of(at) + 1) * self.period - 1

    def unrecord(self, at: int, grace: int, cost: int) -> bool:
        """Returns whether anything is left to write back."""
        for w in range(self.window_of(at), self.window_of(at + grace) + 1):
            self._add(w, -cost)
        return bool(self.windows) or self.full is not None

    def clear_at(self) -> int:
        last = max([*self.windows, *(self.full[1:] if self.full else ())], default=None)
        return 0 if last is None else (last + 1) * self.period

    def fold(self, now: int) -> None:
        """Past ``max_ahead`` windows ahead of the current one, all but the last
        ``keep_ahead``, and what lies between them, count as full from then on."""
        ahead = sorted(k for k in self.windows if k > self.current)
        if len(ahead) <= self.layout.max_ahead:
            return
        lo, hi = ahead[0], ahead[-self.layout.keep_ahead] - 1
        if self.full is not None:
            lo, hi = min(lo, self.full[0]), max(hi, self.full[1])
        for k in ahead:
            if k <= hi:
                del self.windows[k]
        self.full = (lo, hi)

    def holds_units(self) -> bool:
        return bool(self.windows) or self.full is not None

    def entries(self) -> list[int | list[int]]:
        """The stored state: window, units of each window holding units, in order, then
        the folded range [a, b] if there is one."""
        out: list[int | list[int]] = [v for k in sorted(self.windows) for v in (k, self.windows[k])]
        return out + ([list(self.full)] if self.full else [])

    def live(self, stored: list[int | list[int]], now: int) -> list[int | list[int]]:
        current = self.window_of(now)
        pairs, full = stored, None
        if stored and isinstance(stored[-1], list):
            pairs, full = stored[:-1], (stored[-1][0], stored[-1][1])
        out: list[int | list[int]] = [v for k, units in zip(pairs[::2], pairs[1::2])
                                      if k >= current for v in (k, units)]
        trimmed = self._trimmed(full, current)
        return out + ([list(trimmed)] if trimmed else [])

    @staticmethod
    def decode(value: bytes) -> list[int | list[int]]:
        """The stored state: the windows' array, then the folded range's if any."""
        windows, *rest = list(msgpack.Unpacker(BytesIO(value)))
        return [*windows, *rest]


# -- truth --------------------------------------------------------------------------------


def max_units_in_any_interval(admissions: Iterable[tuple[float, int]], period: float) -> int:
    """Most units starting in any half-open interval ``[a, a + period)``.

    ``admissions``: (start time, units) of every call that started. The maximum is
    reached with ``a`` at some start, so only those are tried.
    """
    pairs = sorted(admissions)
    times = [t for t, _ in pairs]
    prefix = [0]
    for _, units in pairs:
        prefix.append(prefix[-1] + units)
    best = 0
    for i, t in enumerate(times):
        j = bisect_left(times, t + period)
        best = max(best, prefix[j] - prefix[i])
    return best


def max_units_per_aligned_window(admissions: Iterable[tuple[float, int]], period: float) -> int:
    """Most units starting in one aligned window ``[k * period, (k + 1) * period)``."""
    totals: dict[int, int] = {}
    for t, units in admissions:
        totals[int(t // period)] = totals.get(int(t // period), 0) + units
    return max(totals.values(), default=0)
