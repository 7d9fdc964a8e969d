"""What the store holds for a scope and key, read without consuming anything: the values
:meth:`.Throttle.acquire` and :meth:`.Throttle.status` answer with, and how they are read
(the rates a state hash holds, as declared, under the live limit; the line; the pause)."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core import timing
from ..core.adapt import scaled_limit
from ..core.cost import too_costly
from ..core.keys import scan_pattern, shadow_key, state_key, target_matches, target_of
from ..core.protocol import Verdict, WindowCall, WindowReply
from ..core.rates import Rate
from ..core.spec import BoundCall, ThrottleSpec, declared_spec
from ..core.state import FOREVER_US, rate_of_field
from ..store.client import RedisStore
from .adaptive import Level, level_of
from .control_fields import ControlSet, control_target

__all__ = [
    "Decision",
    "RateStatus",
    "Shadowed",
    "Status",
    "decision",
    "declared_rates",
    "find_targets",
    "known_specs",
    "paused_until",
    "read_status",
    "unix",
]

#: (scope, throttle) of every throttled task of an app, declared or by rule.
Specs = Sequence[tuple[str, ThrottleSpec]]


@dataclass(frozen=True)
class Decision:
    """The answer of :meth:`Throttle.acquire`."""

    allowed: bool
    #: Seconds until a call of this cost would be admitted (0 when allowed).
    retry_after: float
    #: Units still free now, over the tightest rate.
    remaining: int
    #: Unix time at which everything counted now has left its window.
    reset_at: float


@dataclass(frozen=True)
class RateStatus:
    rate: Rate
    algorithm: str
    used: int
    remaining: int
    reset_at: float


@dataclass(frozen=True)
class Shadowed:
    """What a throttle in shadow mode would have held back of a scope and key, while its
    shadow state lasts (it goes a window after the last check): the starts checked, those
    it would have held back, and the seconds they would have waited in all and at most."""

    checked: int
    held: int
    waited: float
    longest: float

    @classmethod
    def read(cls, state: dict[str, bytes]) -> Shadowed | None:
        if "n" not in state:
            return None
        number = {name: int(state.get(name) or 0) for name in ("n", "h", "w", "m")}
        return cls(number["n"], number["h"], number["w"] / 1e6, number["m"] / 1e6)


@dataclass(frozen=True)
class Status:
    """Current usage of one scope and key, per rate, without consuming anything."""

    scope: str
    key: str | None
    rates: tuple[RateStatus, ...]
    #: Unix time a pause of this scope or key ends (``inf``: until resumed), or None.
    paused_until: float | None = None
    #: The live limit in force (``set_limit`` of this key, else of its scope), or None.
    live_limit: tuple[Rate, ...] | None = None
    #: Tasks released from the line and not started yet (on their way to a worker).
    released: int = 0
    #: Concurrency slots held now (bodies that run), and tasks waiting in the key's line.
    running: int = 0
    waiting: int = 0
    #: The concurrency limit in force: the live one if set, else the one this app's tasks
    #: declare for the scope; or None.
    concurrency: int | None = None
    #: The live concurrency limit (``set_limit(..., concurrency=K)``), or None.
    live_concurrency: int | None = None
    #: Whether the live limit replaces every declared rate (``set_limit(..., replace=True)``):
    #: else a declared rate of a window it does not set stays in force beside it.
    live_replaces_all: bool = False
    #: An adaptive throttle's level (its rates show the limits in force at it), or None.
    adaptive: Level | None = None
    #: The key's cap in its scope's share of :attr:`concurrency` slots (``share=``), or None.
    share_cap: int | None = None
    #: "enforce" or "shadow": the mode in force for this app's throttles of the scope
    #: (the live one, else the code's, else ``throttle_mode``); None: no live mode, and no
    #: task of this app uses the scope.
    mode: str | None = None
    #: What the key's throttle in shadow mode would have held back, while its shadow state
    #: lasts, or None.
    shadow: Shadowed | None = None

    @property
    def remaining(self) -> int | None:
        return min((r.remaining for r in self.rates), default=None)

    def estimate(self, place: int) -> float | None:
        """When the task at ``place`` in the line (1: next) may start, roughly (Unix time):
        behind those released before it, each rate's room now, then a window per limit's
        worth; None for a line of no rate (it waits for a slot)."""
        if not self.rates:
            return None
        now, start = time.time(), time.time()
        for r in self.rates:
            ahead = place + self.released - r.remaining
            if ahead > 0:
                windows = math.ceil(ahead / r.rate.limit)
                start = max(start, max(r.reset_at, now) + (windows - 1) * r.rate.period
                            if windows == 1 else now + windows * r.rate.period)
        return start


def known_specs(app: Any, rule_for: Callable[[str], ThrottleSpec | None]) -> list[tuple[str, ThrottleSpec]]:
    """(scope, throttle) of every throttled task of ``app``, declared or by rule (a scope
    that is the task's name where none is given)."""
    out = []
    for name, task in list(app.tasks.items()):
        spec = declared_spec(task) or (None if name.startswith("celery.") else rule_for(name))
        if spec is not None:
            out.append((spec.scope or name, spec))
    return out


def declared_rates(specs: Specs, scope: str) -> tuple[tuple[Rate, ...], bool]:
    """The rates the throttles of ``scope`` declare, and whether one of them declares its
    rates by a callable (known only per call)."""
    declared: set[Rate] = set()
    by_callable = False
    for known, spec in specs:
        if known == scope:
            if isinstance(spec.rates, tuple):
                declared.update(spec.rates)
            else:
                by_callable = True
    return tuple(sorted(declared)), by_callable


def find_targets(store: RedisStore, prefix: str, controls: ControlSet, match: str, limit: int,
                 scope: str | None, key_match: str | None) -> tuple[list[tuple[str, str | None]], bool]:
    """Every (scope, key) the store holds a window, a pause or a live limit for, whose scope
    matches the glob ``match`` and key the glob ``key_match`` (:func:`.keys.target_matches`;
    and, if given, whose scope is ``scope``); found by SCAN, never KEYS. At most ``limit``
    of them, in order; the flag is True if more were left."""
    found: dict[tuple[str, str | None], None] = {}
    more = False
    named = (target_of(prefix, name) for name in store.scan(scan_pattern(prefix)))
    controlled = (control_target(field) for field in controls.fields())
    for target in itertools.chain(controlled, named):
        if (target is None or target in found or not target_matches(*target, match, key_match)
                or (scope is not None and target[0] != scope)):
            continue
        if len(found) >= limit:
            more = True
            break
        found[target] = None
    return sorted(found, key=lambda t: (t[0], t[1] is not None, t[1] or "")), more


def declared_windows(margin: float | None, specs: Specs, scope: str, live_rates: Sequence[Rate]) -> dict[int, int]:
    """The window lengths (µs) declared for ``scope`` (by its tasks' fixed rates, by
    decorator or rule, and its live limit), by the window a sliding one is counted over
    (each with its throttle's margin, else the setting's, ``margin``)."""
    margins = {margin}
    periods = {r.period_us for r in live_rates}
    for known, spec in specs:
        if known == scope and isinstance(spec.rates, tuple):
            periods.update(r.period_us for r in spec.rates)
            margins.add(margin if spec.margin is None else spec.margin)
    return {timing.widened_period_us(period, m): period for period in periods for m in margins}


def read_status(store: RedisStore, prefix: str, margin: float | None, specs: Specs, controls: ControlSet,
                scope: str, key: str | None, app_mode: str = "enforce") -> Status:
    """The status of ``scope``/``key``: each rate its state hash holds (shown as declared,
    under the live limit), the line, the slots and the pause."""
    hash_key = state_key(prefix, scope, key)
    live_rates = controls.limit_of(scope, key)
    live = {(r.period_us, r.unit): r for r in live_rates or ()}
    seen: set[tuple[str, Rate, Rate, str]] = set()
    declared = declared_windows(margin, specs, scope, live_rates or ())
    state = store.read(hash_key)
    for field in state:
        named = rate_of_field(field)
        if named is not None:
            algorithm, limit, stored_us, unit = named
            # Shown as declared (a window with its margin as the rate without it),
            # counted over the window stored. The limit in force: the live one of
            # this window length and unit, if set.
            declared_us = declared.get(stored_us) if algorithm == "sliding" else None
            if declared_us is None:  # (a direct acquire's, or a rule's: widened the same way)
                declared_us = (timing.declared_period_us(stored_us) if algorithm == "sliding" else None) \
                    or stored_us
            rate = live.get((declared_us, unit)) or Rate(limit, declared_us / 1_000_000, unit)
            seen.add((algorithm, rate, Rate(rate.limit, stored_us / 1_000_000, unit), field))
    adapt = next((spec.adapt for known, spec in specs if known == scope and spec.adapt is not None), None)
    adaptive = None
    if adapt is not None and seen:
        window_us = min(counted.period_us for _, _, counted, _ in seen)
        adaptive = level_of(adapt, state.get("A"), store.now_us(), window_us)
    out = []
    for algorithm, rate, counted, field in sorted(seen):
        if adaptive is not None:  # (shown and counted at the limit in force)
            rate = Rate(scaled_limit(rate.limit, adaptive.share), rate.period, rate.unit)
            counted = Rate(rate.limit, counted.period, counted.unit)
        reply = store.peek(hash_key, WindowCall(algorithm, (counted,), fields=(field,)))
        used = rate.limit - reply.remaining
        reset_at = (reply.clear_at_us or reply.now_us) / 1e6
        out.append(RateStatus(rate, algorithm, used, reply.remaining, reset_at))
    line = store.peek(hash_key, WindowCall("sliding", ()))
    slot_limits = [spec.concurrency for known, spec in specs if known == scope and spec.concurrency]
    shared = key is not None and any(known == scope and spec.share is not None for known, spec in specs)
    live_slots = controls.concurrency_of(scope, None if shared else key)
    share_cap = store.share_read([hash_key])[0][0] if shared else None
    own = [spec for known, spec in specs if known == scope]
    mode = controls.mode_of(scope, key) or next((spec.mode for spec in own if spec.mode), None) or (
        app_mode if own else None)
    return Status(scope, key, tuple(out), paused_until(store, controls, scope, key), live_rates or None,
                  line.out, line.running, line.waiting, live_slots or max(slot_limits, default=None), live_slots,
                  live_rates is not None and controls.replaces_all(scope, key), adaptive, share_cap, mode,
                  Shadowed.read(store.read(shadow_key(hash_key))))


def paused_until(store: RedisStore, controls: ControlSet, scope: str, key: str | None) -> float | None:
    """When the pause covering ``scope``/``key`` ends (Unix time), or None."""
    until = controls.paused_until(scope, key)
    if not until or until < store.now_us():
        return None
    return unix(until)


def unix(until_us: int) -> float:
    """A time the store gives (µs) as Unix time; a pause with no end as ``inf``."""
    return float("inf") if until_us >= FOREVER_US else until_us / 1e6


def decision(call: BoundCall, reply: WindowReply) -> Decision:
    """The answer of a direct ``acquire`` of ``call``, from the window script's reply (a
    cost that never fits its rates: a ThrottleError)."""
    if reply.verdict is Verdict.REFUSED:
        raise too_costly(call.scope, call.rates, call.cost)
    return Decision(
        allowed=reply.allowed,
        retry_after=0.0 if reply.allowed else reply.wait_us / 1e6,
        remaining=reply.remaining,
        reset_at=(reply.clear_at_us or reply.now_us) / 1e6,
    )
