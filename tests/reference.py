"""A pure-Python reference model of the window scripts, and a plain truth checker.

``WindowModel`` does exactly what ``celery_throttle/lua/window.lua`` does with
``sliding.lua`` or ``fixed.lua`` prepended, under the same timing policy
(``celery_throttle.timing.ScriptPolicy``, which the store loads the scripts with): same
state, same arithmetic (the Lua numbers are doubles; every time here stays below 2**53,
where Python ints and Lua doubles agree, and divisions are written as float divisions
like the Lua's), same reply. Tests run the
real scripts against it operation by operation. Besides the windows' own fields, the
hash holds its epoch (field ``e``, the time it was first written); a reservation names
the epoch it was made in, and a claim from another epoch is an ordinary acquire.

The truth checker knows nothing of buckets or reservations: given the (start time,
units) of every call that actually started, it measures the most units in any half-open
interval of one period (sliding) or in any aligned window (fixed).

Times are integer microseconds throughout.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from io import BytesIO
from typing import Protocol

import msgpack

from celery_throttle.protocol import STATE_FORMAT, STATE_LAYOUT, Code, StateLayout
from celery_throttle.timing import SCRIPT_POLICY, ScriptPolicy

__all__ = [
    "EPOCH_FIELD",
    "SLOTS",
    "Claim",
    "FixedRate",
    "ModelReply",
    "SlidingRate",
    "WindowModel",
    "max_units_in_any_interval",
    "max_units_per_aligned_window",
    "per_rate",
]

#: Buckets per period of a sliding window, as the scripts are loaded with it by default
#: (protocol.StateLayout says what each constant of the layout is; a model built with
#: another layout uses that one).
SLOTS = STATE_LAYOUT.slots


class Claim(Protocol):
    """What a claim carries: ``celery_throttle.protocol.Reservation`` fits."""

    start_us: int
    latest_us: int
    #: Units of every rate, or one count per rate (its rates count different units).
    cost: int | tuple[int, ...]
    grace_us: int
    epoch: int
    lead_us: int


def per_rate(cost: int | tuple[int, ...], n: int) -> tuple[int, ...]:
    """A call's cost as a count per rate (one number counts in every rate); a count per
    rate of another length is refused, as the script refuses it."""
    if isinstance(cost, int):
        return (cost,) * n
    if len(cost) != n:
        raise ValueError(f"{n} rates, counts {cost}")
    return tuple(cost)


@dataclass(frozen=True)
class ModelReply:
    """Fields in the order of ``celery_throttle.store.WindowReply``."""

    code: int
    wait_us: int
    remaining: int
    clear_at_us: int
    start_us: int
    latest_us: int
    now_us: int
    epoch: int
    lead_us: int
    grace_us: int
    leased: int = 0
    #: An admit that fits, of a call with a cost per rate: each rate's room.
    rooms: list[int] | tuple[()] = ()

    def as_tuple(self) -> tuple[int | list[int] | tuple[()], ...]:
        return (self.code, self.wait_us, self.remaining, self.clear_at_us, self.start_us,
                self.latest_us, self.now_us, self.epoch, self.lead_us, self.grace_us, self.leased, self.rooms)


# -- sliding ------------------------------------------------------------------------------


@dataclass
class Bucket:
    units: int
    latest: int


class SlidingRate:
    """One rate of a sliding window: buckets keyed by floor(latest / slot)."""

    tag = "s"

    def __init__(self, limit: int, period_us: int, layout: StateLayout = STATE_LAYOUT, unit: str = "") -> None:
        self.limit = limit
        self.period = period_us
        self.layout = layout
        self.unit = unit
        self.slot = max(math.ceil(period_us / layout.slots), 1000)
        self.field = f"{self.tag}{limit}/{period_us}" + (f".{unit}" if unit else "")
        self.buckets: dict[int, Bucket] = {}

    def bucket_of(self, latest: int) -> int:
        return math.floor(latest / self.slot)

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
        if isinstance(values[0], list):  # a flat list, as earlier versions wrote it
            return values[0]
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


# -- the script ---------------------------------------------------------------------------

_ALGORITHMS = {"sliding": SlidingRate, "fixed": FixedRate}


#: The hash field holding its epoch: the time (µs) the hash was created.
EPOCH_FIELD = "e"
#: The hash field holding its format (protocol.STATE_FORMAT), written with the epoch.
FORMAT_FIELD = "f"


@dataclass(frozen=True)
class _Call:
    """What window.lua is told about one call (its ARGV, decoded)."""

    now: int
    #: The units of each rate (a call of one cost: the same for every rate).
    costs: tuple[int, ...]
    #: Whether its cost was one number for every rate (only such a call takes a lease).
    uniform: bool
    reserve: bool
    grace_us: int
    slack_us: int
    lease: int
    lease_span_us: int
    max_wait_us: int
    not_before_us: int
    pause_horizon_us: int
    #: The shortest window of the rates.
    shortest: int


class WindowModel:
    """The state of one hash (one scope and key) for one algorithm and set of rates."""

    def __init__(self, algorithm: str, rates: Sequence[tuple[int, int] | tuple[int, int, str]], *,
                 fold: bool = True, policy: ScriptPolicy = SCRIPT_POLICY, layout: StateLayout = STATE_LAYOUT) -> None:
        """``rates``: (limit, period in µs) pairs, or (limit, period, unit) for a rate that
        counts a unit of its own, in the order they are sent to Redis.
        ``fold=False``: never fold a deep backlog (not what the scripts do: the exact
        state that folding summarises, to compare decisions with). ``policy``: the
        timing policy the scripts were loaded with; ``layout``, their state layout."""
        cls = _ALGORITHMS[algorithm]
        self.algorithm = algorithm
        self.folds = fold
        self.policy = policy
        self.layout = layout
        self.rates: list[SlidingRate | FixedRate] = [cls(r[0], r[1], layout, *r[2:]) for r in rates]
        #: The hash's field "e": the time it was first written; None while it does not
        #: exist. A claim made in another epoch is neither honoured nor given back.
        self.epoch: int | None = None
        #: Fields "d" and "v": the learnt dispatch delay and its mean deviation (µs).
        self.delay: int | None = None
        self.jitter: int | None = None

    def reset(self) -> None:
        """The hash is gone (deleted, expired, lost): a new epoch starts with its next write."""
        self.rates = [type(r)(r.limit, r.period, self.layout, r.unit) for r in self.rates]
        self.epoch = None
        self.delay = self.jitter = None

    # window.lua, operation by operation (its twin: the same functions, in the same order)
    def window(
        self,
        now: int,
        op: str,
        cost: int | tuple[int, ...],
        *,
        reserve: bool = False,
        grace_us: int = 0,
        slack_us: int = 0,
        claim: Claim | None = None,
        learn: bool = True,
        resumed: bool = False,
        lease: int = 0,
        lease_span_us: int = 0,
        max_wait_us: int = 0,
        not_before_us: int = 0,
        pause_horizon_us: int = 2**53,
        early_us: int = 0,
    ) -> ModelReply:
        for r in self.rates:
            r.load(now)
        costs, uniform = per_rate(cost, len(self.rates)), isinstance(cost, int)
        if op == "settle":  # (its cost is what it reports: not checked)
            call = _Call(now, costs, uniform, False, grace_us, slack_us, 0, 0, 0, 0, pause_horizon_us,
                         min(r.period for r in self.rates))
            return self._settle(call, claim)
        # The cost is checked here, once, for every operation.
        for r, units in zip(self.rates, costs):
            if units > r.limit:
                return ModelReply(Code.TOO_COSTLY, 0, 0, 0, 0, 0, now, 0, -1, 0, 0)
        call = _Call(now, costs, uniform, reserve, grace_us, slack_us, lease, lease_span_us,
                     max_wait_us, not_before_us if not_before_us > now else 0,  # a pause that is over changes nothing
                     pause_horizon_us, min(r.period for r in self.rates))
        if op == "claim":
            return self._claim(call, claim, learn, resumed, early_us)
        if op == "settle":
            return self._settle(call, claim)
        operation = {"acquire": self._acquire, "screen": self._screen, "reserve": self._reserve,
                     "admit": self._admit, "peek": self._peek}[op]
        return operation(call)

    # -- what every operation shares
    def _reply(self, c: _Call, code: int, wait: int, start: int, latest: int, grace: int = 0,
               leased: int = 0, rooms: list[int] | tuple[()] = ()) -> ModelReply:
        return ModelReply(code, wait, self.remaining(c.now), self.clear_at(), start, latest, c.now,
                          self.epoch or 0, self.lead(), grace, leased, rooms)

    def _written(self, c: _Call) -> None:
        """write_back() set a field: the deep backlog folds, and a new hash gets its epoch."""
        if self.folds:
            for r in self.rates:
                r.fold(c.now)
        if self.epoch is None:
            self.epoch = c.now

    def _earliest(self, c: _Call, start: int) -> tuple[int, bool]:
        x, settled = start, False
        for _ in range(self.policy.settle_rounds):
            settled = True
            for r, units in zip(self.rates, c.costs):
                e = r.earliest(x, units, c.slack_us)
                if e > x:
                    x, settled = e, False
            if settled:
                break
        return x, settled

    def _lease_fits(self, c: _Call, units: tuple[int, ...], span: int) -> bool:
        """Whether ``units`` (of each rate) started anywhere in [now, now + span] fit, every
        rate staying at most half full."""
        return all(2 * (max(r.usage(c.now), r.usage(c.now + span)) + u) <= r.limit
                   and r.earliest(c.now, u, span) == c.now for r, u in zip(self.rates, units))

    def _record_reserved(self, c: _Call, x: int) -> tuple[int, int]:
        """(latest start, grace given) of a start reserved at x."""
        p, grace = self.policy, c.grace_us
        if self.jitter is not None:  # (what is learnt is capped; the caller's least grace is not)
            grace = max(grace, min(p.grace_jitters * self.jitter + p.grace_slacks * c.slack_us,
                                   math.floor(c.shortest / p.learnt_cap_parts)))
        return min(r.record(x, x + grace, units) for r, units in zip(self.rates, c.costs)), grace

    def _check(self, c: _Call, runs: str | None, reserving: bool, start_from: int, lease: int,
               written: bool = False) -> ModelReply:
        if c.not_before_us - c.now > c.pause_horizon_us:
            # A long pause reserves nothing (a resume must let its tasks go): check later.
            if written:
                self._written(c)
            return self._reply(c, Code.DENIED, c.pause_horizon_us, 0, 0)
        x, settled = self._earliest(c, start_from)
        code, start, latest, grace, leased = Code.DENIED, 0, 0, 0, 0
        if settled and x == c.now and runs == "screen":
            code = Code.RUN  # fits now: recorded by the acquire that follows, not here
        elif settled and x == c.now and runs == "record":
            code = Code.RUN
            units, span = c.costs, c.slack_us
            if lease > (c.costs[0] if c.uniform else 1):
                # A lease over [now, now + span], only while every rate stays at most half
                # full with it: `lease` units of every rate (a call of one cost), or
                # `lease` calls like this one (a cost per rate)
                wide = max(c.lease_span_us, c.slack_us)
                leased_units = (lease,) * len(self.rates) if c.uniform else tuple(lease * u for u in c.costs)
                if self._lease_fits(c, leased_units, wide):
                    units, span, leased = leased_units, wide, lease
            for r, u in zip(self.rates, units):
                r.record(c.now, c.now + span, u)
            written = True
        elif settled and reserving and c.max_wait_us > 0 and x - max(c.now, c.not_before_us) > c.max_wait_us:
            code = Code.TOO_FAR  # further than the caller will wait: nothing reserved
        elif settled and reserving:
            code, start = Code.RESERVED, x
            latest, grace = self._record_reserved(c, x)
            written = True
        if written:
            self._written(c)
        return self._reply(c, code, x - c.now, start, latest, grace, leased)

    # -- the operations
    def _acquire(self, c: _Call) -> ModelReply:
        return self._check(c, "record", c.reserve, max(c.now, c.not_before_us), c.lease)

    def _screen(self, c: _Call) -> ModelReply:
        return self._check(c, "screen", c.reserve, max(c.now, c.not_before_us), 0)

    def _reserve(self, c: _Call) -> ModelReply:
        start_from = max(c.now, c.not_before_us)
        if self.delay is not None:  # at publish: not before it arrives
            start_from = max(start_from, c.now + self.lead())
        return self._check(c, None, True, start_from, 0)

    def _admit(self, c: _Call) -> ModelReply:
        # At publish: fits, every rate at most half full: not recorded
        half = [math.floor(r.limit / 2) - max(r.usage(c.now), r.usage(c.now + c.slack_us)) for r in self.rates]
        if not c.not_before_us and all(h >= units and r.earliest(c.now, units, c.slack_us) == c.now
                                       for h, r, units in zip(half, self.rates, c.costs)):
            return self._reply(c, Code.RUN, 0, 0, 0, 0, min(half), () if c.uniform else half)
        return self._reserve(c)

    def _claim(self, c: _Call, claim: Claim | None, learn: bool, resumed: bool, early_us: int) -> ModelReply:
        # A reservation made in another epoch (or none: RedisStore sends '' without a
        # claim) is not honoured and gives nothing back: the call is an acquire.
        if claim is None or self.epoch is None or str(claim.epoch) != str(self.epoch):
            return self._acquire(c)
        p = self.policy
        c_start, c_latest = claim.start_us, claim.latest_us
        trip = c.now - (c_start - claim.lead_us)
        if learn and not resumed and trip <= p.learn_outlier_ms * 1000:  # the trip back, beyond the lead it was given
            sample = max(0, min(trip, math.floor(c.shortest / p.learnt_cap_parts)))
            if self.delay is None or self.jitter is None:
                self.delay, self.jitter = sample, math.floor(sample / 2)
            else:
                err = sample - self.delay
                self.delay += math.floor(err / p.delay_gain_parts)
                self.jitter += math.floor((abs(err) - self.jitter) / p.jitter_gain_parts)
        # A pause now covers its start, or the pause it was reserved behind was lifted
        # since: give it back and check again
        paused = c_start < c.not_before_us or resumed
        # A little early (at most early_us), and its start leaves the slack: granted, to
        # start at its start
        granted = c.now < c_start and c_start - c.now <= early_us and c_start + c.slack_us <= c_latest
        if c.now < c_start and not paused and not granted:
            return self._reply(c, Code.EARLY, c_start - c.now, c_start, c_latest)
        if granted and not paused:
            return self._reply(c, Code.RUN_AT, c_start - c.now, c_start, c_latest)
        # On time only if the body, starting within `slack` of now, stays inside the
        # reserved span.
        if c.now + c.slack_us <= c_latest and not paused:
            return self._reply(c, Code.RUN, 0, c_start, c_latest)
        # Late: give the reserved units back, then try afresh.
        written = False
        for r, units in zip(self.rates, per_rate(claim.cost, len(self.rates))):
            written = r.unrecord(c_start, claim.grace_us, units) or written
        return self._check(c, "record", c.reserve, max(c.now, c.not_before_us), 0, written)

    def _settle(self, c: _Call, counted: Claim | None) -> ModelReply:
        """A started call reports its real cost: ``counted.cost`` units (its report less
        what was counted; negative, a refund) are added to the span it was counted in,
        ``[counted.start_us, counted.latest_us]``, in the epoch it was counted in."""
        if counted is None:
            return self._reply(c, Code.RUN, 0, 0, 0)
        at, latest = counted.start_us, counted.latest_us
        from_lease = at == 0
        if from_lease:  # admitted from a lease: a refund stays counted, an overrun counts from now
            at, latest = c.now, c.now + latest
        elif self.epoch is None or str(counted.epoch) != str(self.epoch):
            return self._reply(c, Code.RUN, 0, 0, 0)
        touched = False
        for r, delta in zip(self.rates, per_rate(counted.cost, len(self.rates))):
            if delta == 0 or (from_lease and delta < 0):
                continue
            if latest + r.period <= c.now:
                continue  # (counted so long ago that nothing of it counts any more)
            if delta > 0:
                r.record(at, latest, delta)
            else:
                r.unrecord(at, latest - at, -delta)
            touched = True
        if touched:
            self._written(c)
        return self._reply(c, Code.RUN, 0, 0, 0)

    def _peek(self, c: _Call) -> ModelReply:
        x, _ = self._earliest(c, max(c.now, c.not_before_us))
        return self._reply(c, Code.RUN if x == c.now else Code.DENIED, x - c.now, 0, 0)

    def lead(self) -> int:
        """The learnt delay plus a margin of 2 v, at most half the busiest rate's spacing."""
        if self.delay is None or self.jitter is None:
            return -1
        half_pace = min(math.floor(r.period / r.limit / 2) for r in self.rates)
        return self.delay + min(self.policy.lead_jitters * self.jitter, half_pace)

    def remaining(self, now: int) -> int:
        free = min((r.limit - r.usage(now) for r in self.rates), default=0)
        return max(free, 0)

    def clear_at(self) -> int:
        return max((r.clear_at() for r in self.rates), default=0)

    # what the hash should hold
    def fields(self) -> dict[str, str | list[int]]:
        out: dict[str, str | list[int]] = {}
        if self.epoch is not None:
            out.update({EPOCH_FIELD: str(self.epoch), FORMAT_FIELD: str(STATE_FORMAT)})
        if self.delay is not None:
            out.update(d=str(self.delay), v=str(self.jitter))
        for r in self.rates:
            if r.holds_units():
                out[r.field] = r.entries()
        return out

    def live_stored_fields(self, stored: dict[str, bytes], now: int) -> dict[str, str | list[int]]:
        """The stored hash as load() sees it at ``now``: each rate's list decoded, less what no longer counts (that is only dropped when a script writes
        the rate back). A field that belongs to none of the rates is kept, so that a
        comparison with :meth:`fields` reports it.
        """
        out: dict[str, str | list[int]] = {}
        by_field = {r.field: r for r in self.rates}
        for name, value in stored.items():
            rate = by_field.get(name)
            if rate is None:
                out[name] = value.decode()
            elif live := rate.live(rate.decode(value), now):
                out[name] = live
        return out


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
