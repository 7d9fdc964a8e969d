"""The Throttle controller: the limiter as users and operators call it (``acquire``,
``status``, ``pause``, ``set_limit``, ...), over the settings and the store connections it
owns, and the :class:`.checker.Checker` the hook, the screen and publish check calls with."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core import timing
from ..core.config import ALGORITHMS, Settings, require_redis_url
from ..core.errors import ConfigurationError
from ..core.keys import scan_pattern, state_key, target_matches, target_of
from ..core.locks import ForkSafeLock
from ..core.protocol import WindowCall, WindowReply
from ..core.rates import UNIT_NAME, Rate, parse_rates
from ..core.spec import BoundCall, ThrottleSpec, declared_spec, rate_costs
from ..core.state import FOREVER_US, rate_of_field
from ..store.client import RedisStore
from ..store.parking import ParkingStore
from .checker import Checker
from .controls import (
    REPLACE_ALL,
    ControlSet,
    control_target,
    limit_field,
    parse_controls,
    pause_field,
    replace_field,
    slots_field,
)
from .hints import Hints
from .lines import Lines
from .metrics import Metrics
from .slots import Slots

__all__ = ["Decision", "RateStatus", "Status", "Throttle"]

logger = logging.getLogger("celery_throttle")



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


class Throttle:
    """Global limits for one Celery app. Get it from :func:`celery_throttle.install`."""

    def __init__(self, app: Any, overrides: Mapping[str, Any] | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        self.app = app
        self._overrides = dict(overrides or {})
        self._clock = clock
        self._settings: Settings | None = None
        self._store: RedisStore | None = None
        self._quick_store: RedisStore | None = None
        self._parking: ParkingStore | None = None
        self._slots: Slots | None = None
        self._lines: Lines | None = None
        self._lock = ForkSafeLock()
        #: The checks of this app's calls (the hook, the screen and publish use it).
        self.checker = Checker(self)
        self._metrics: Metrics | None = None
        #: What this process may send unchecked at publish (see :mod:`.publish`).
        self.hints = Hints()
        #: The store's run id as last seen (a change: the store restarted), or None.
        self.store_run_id: str | None = None
        #: Where long waits go in the broker (:func:`.broker_parking.broker_parking`), once
        #: looked at; False: in the store.
        self.broker_parking: Any = None

    # -- configuration ----------------------------------------------------------------
    def configure(self, overrides: Mapping[str, Any]) -> None:
        """Apply more overrides (``install`` called again with settings)."""
        with self._lock:
            self._overrides.update(overrides)
            self._settings = None
            self.checker.forget()
            self.broker_parking = None
        self.close()
        _ = self.settings  # validate now, loudly

    @property
    def settings(self) -> Settings:
        """Settings, read from ``app.conf`` on first use (the app may be configured
        after ``install``)."""
        if self._settings is None:
            self._settings = Settings.from_app(self.app, self._overrides)
        return self._settings

    @property
    def metrics(self) -> Metrics:
        """What this process counts (Prometheus with the extra) and logs about it."""
        if self._metrics is None:
            self._metrics = Metrics(with_keys=self.settings.metrics_keys)
        return self._metrics

    @property
    def store(self) -> RedisStore:
        """The Redis store, connected on first use (in the process that uses it)."""
        return self._store or self._open("_store")

    @property
    def parking(self) -> ParkingStore:
        """The parked messages of :attr:`store`."""
        parking = self._parking
        if parking is None or parking.store is not self.store:
            parking = self._parking = ParkingStore(self.store)
        return parking

    @property
    def slots(self) -> Slots:
        """This process's concurrency slots (:mod:`.slots`)."""
        if self._slots is None:
            self._slots = Slots(self)
        return self._slots

    @property
    def lines(self) -> Lines:
        """This process's side of the lines (:mod:`.lines`)."""
        if self._lines is None:
            self._lines = Lines(self)
        return self._lines

    @property
    def quick_store(self) -> RedisStore:
        """The store, through a connection that gives up after QUICK_TIMEOUT."""
        return self._quick_store or self._open("_quick_store", timing.QUICK_TIMEOUT)

    def _open(self, attribute: str, quick_timeout: float | None = None) -> RedisStore:
        with self._lock:
            if getattr(self, attribute) is None:
                s = self.settings
                options = dict(s.redis_options)
                timeout, connect_timeout = timing.STORE_TIMEOUT, timing.STORE_CONNECT_TIMEOUT
                if quick_timeout is not None:
                    # The quick store's timeouts are the point of it, whatever the options say.
                    options.pop("socket_timeout", None)
                    options.pop("socket_connect_timeout", None)
                    timeout = connect_timeout = quick_timeout
                opened = RedisStore(require_redis_url(self.app, s), s.key_prefix, clock=self._clock,
                                    timeout=timeout, connect_timeout=connect_timeout, options=options)
                other = self._quick_store if attribute == "_store" else self._store
                if other is not None:
                    opened.rtt_us = other.rtt_us  # (the same store, as far away)
                setattr(self, attribute, opened)
            store: RedisStore = getattr(self, attribute)
            return store

    def close(self) -> None:
        """Close the connections to the store (a later call opens new ones)."""
        with self._lock:
            for store in (self._store, self._quick_store):
                if store is not None:
                    store.close()
            self._store = self._quick_store = None

    def acquire(
        self,
        scope: str,
        key: str | None = None,
        rates: str | Sequence[str] = (),
        cost: int | Mapping[str, int] = 1,
        algorithm: str | None = None,
    ) -> Decision:
        """Consume ``cost`` units of ``scope`` (and ``key``) now if every rate admits it;
        for rates of named units, a cost by unit: ``cost={"tokens": 1200}`` (a unit not
        named: 1).

        A denial consumes nothing. ``retry_after`` says when the same call would fit. It
        shares the count of the tasks that name the same scope, key and rates (with the
        same margin: ``throttle_margin``, or 2% of each sliding window, at most 20 ms), and
        waits its turn behind the tasks in their line: it is not admitted while any wait.
        """
        call = self.checker.finish_bind(self._direct_call(scope, key, rates, cost, algorithm), None)
        reply = self.checker.acquire(call)
        return _decision(reply)

    def status(self, scope: str, key: str | None = None) -> Status:
        """Usage of every rate stored for ``scope``/``key``, consuming nothing."""
        return self._status(scope, key, parse_controls(self.store.controls()))

    def statuses(self, match: str = "*", limit: int = 200, scope: str | None = None,
                 key_match: str | None = None) -> tuple[list[Status], bool]:
        """The status of every scope and key that Redis holds a window, a pause or a live
        limit for, whose scope matches the glob ``match`` and key the glob ``key_match``
        (:func:`.keys.target_matches`; and, if given, whose scope is ``scope``); found by
        SCAN, never KEYS. At most ``limit`` of them; the flag is True if more were left."""
        prefix = self.settings.key_prefix
        controls = parse_controls(self.store.controls())
        found: dict[tuple[str, str | None], None] = {}
        more = False
        named = (target_of(prefix, name) for name in self.store.scan(scan_pattern(prefix)))
        controlled = (control_target(field) for field in controls.fields())
        for target in itertools.chain(controlled, named):
            if (target is None or target in found or not target_matches(*target, match, key_match)
                    or (scope is not None and target[0] != scope)):
                continue
            if len(found) >= limit:
                more = True
                break
            found[target] = None
        ordered = sorted(found, key=lambda t: (t[0], t[1] is not None, t[1] or ""))
        return [self._status(scope, key, controls) for scope, key in ordered], more

    def known_scopes(self) -> list[str]:
        """The scopes this app's throttled tasks use (declared or by rule; a scope that
        is the task's name where none is given)."""
        return sorted({scope for scope, _ in self._known_specs()})

    def _known_specs(self) -> list[tuple[str, ThrottleSpec]]:
        """(scope, throttle) of every throttled task of this app, declared or by rule."""
        out = []
        for name, task in list(self.app.tasks.items()):
            spec = declared_spec(task) or (None if name.startswith("celery.") else self.checker.rule_for(name))
            if spec is not None:
                out.append((spec.scope or name, spec))
        return out

    def _declared_windows(self, scope: str, live_rates: Sequence[Rate]) -> dict[int, int]:
        """The window lengths (µs) declared for ``scope`` (by its tasks' fixed rates, by
        decorator or rule, and its live limit), by the window a sliding one is counted over
        (each with its throttle's margin, else the setting's)."""
        margins = {self.settings.margin}
        periods = {r.period_us for r in live_rates}
        for known, spec in self._known_specs():
            if known == scope and isinstance(spec.rates, tuple):
                periods.update(r.period_us for r in spec.rates)
                margins.add(self.settings.margin if spec.margin is None else spec.margin)
        return {timing.widened_period_us(period, margin): period for period in periods for margin in margins}

    def _status(self, scope: str, key: str | None, controls: ControlSet) -> Status:
        hash_key = state_key(self.settings.key_prefix, scope, key)
        live_rates = controls.limit_of(scope, key)
        live = {(r.period_us, r.unit): r for r in live_rates or ()}
        seen: set[tuple[str, Rate, Rate, str]] = set()
        declared = self._declared_windows(scope, live_rates or ())
        for field in self.store.read(hash_key):
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
        out = []
        for algorithm, rate, counted, field in sorted(seen):
            reply = self.store.peek(hash_key, WindowCall(algorithm, (counted,), fields=(field,)))
            used = rate.limit - reply.remaining
            reset_at = (reply.clear_at_us or reply.now_us) / 1e6
            out.append(RateStatus(rate, algorithm, used, reply.remaining, reset_at))
        line = self.store.peek(hash_key, WindowCall("sliding", ()))
        slot_limits = [spec.concurrency for known, spec in self._known_specs() if known == scope and spec.concurrency]
        live_slots = controls.concurrency_of(scope, key)
        return Status(scope, key, tuple(out), self._paused_until(controls, scope, key), live_rates or None,
                      line.out, line.running, line.waiting, live_slots or max(slot_limits, default=None), live_slots,
                      live_rates is not None and controls.replaces_all(scope, key))

    def pause(self, scope: str, key: str | None = None, seconds: float | None = None) -> float:
        """Start nothing of ``scope`` (or of its ``key``) for ``seconds`` (None: until
        :meth:`resume`), on every worker within CONTROL_REFRESH. Tasks that arrive wait in
        their key's line, never failed by it; the line's head goes when the pause is over.
        A longer pause already set stays. Returns when it ends (Unix time; ``inf``: never)."""
        self._direct_call(scope, key, "1/s", 1, None)  # (validates scope and key)
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not 0 < seconds < 10 * 365 * 86400):
            raise ConfigurationError(f"pause seconds must be a positive number (or None: until resumed), "
                                     f"got {seconds!r}")
        field = pause_field(scope, key)
        until = self.store.pause(field, seconds)
        self.checker.controls.note(field, str(until))
        logger.warning("paused scope %r%s %s", scope, "" if key is None else f" key {key!r}",
                       "until resumed" if until == FOREVER_US else f"for {seconds:.1f}s")
        return _unix(until)

    def resume(self, scope: str, key: str | None = None) -> bool:
        """End a pause of ``scope`` (or of its ``key``) now. True if there was one.

        Every line the pause held (of this scope, or key) gets a look at once: a worker's
        releaser is woken, and sends their heads as their keys have room (the workers send
        them, with their own app's routing, not this process)."""
        self._direct_call(scope, key, "1/s", 1, None)
        field = pause_field(scope, key)
        self.checker.controls.note(field, None)
        found = self.store.clear_control(field)
        if found:
            woken = self.lines.wake(scope, key)
            logger.warning("resumed scope %r%s: %d line(s) it held get a look now", scope,
                           "" if key is None else f" key {key!r}", woken)
        return found

    def set_limit(self, scope: str, rates: str | Sequence[str] | None = None, key: str | None = None, *,
                  concurrency: int | None = None, replace: bool = False) -> tuple[Rate, ...]:
        """Limit ``scope`` (every key of it that has no limit of its own, or only ``key``)
        to ``rates``, and (``concurrency``) to K bodies running at once, instead of what
        the code declares, on every worker within CONTROL_REFRESH, until
        :meth:`clear_limit`. A live rate takes the place of the declared rate of its window
        length and unit; the declared rates of other windows stay in force beside it (a
        live ``2/s`` on ``10/s, 5000/h``: ``2/s, 5000/h``), unless ``replace`` (then the
        live rates alone are in force; :meth:`rates_in_force` says which are). The tasks waiting in the lines of the scope (or key) get a look
        at once: a raised limit lets them go now. A lowered one holds back the heads of the
        lines, and a task released under the old limit that finds no room when it arrives
        goes back to its place; a lowered K lets the bodies running end, and starts no more
        until fewer than K run. Returns the rates set (empty with ``concurrency`` alone)."""
        if rates is None and concurrency is None:
            raise ConfigurationError("set_limit takes rates, a concurrency, or both")
        if replace and rates is None:
            raise ConfigurationError("set_limit(replace=True) replaces the declared rates: give the rates")
        if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                        or concurrency < 1):
            raise ConfigurationError(f"concurrency must be a positive integer, got {concurrency!r}")
        parsed = self._direct_call(scope, key, "1/s" if rates is None else rates, 1, None).rates
        target = f"scope {scope!r}" + ("" if key is None else f" key {key!r}")
        if rates is not None:
            field, value = limit_field(scope, key), ",".join(map(str, parsed))
            replacing = replace_field(scope, key)
            if replace:
                self.store.set_controls({field: value, replacing: REPLACE_ALL})
            else:
                self.store.set_controls({field: value}, clear=(replacing,))
            self.checker.controls.note(field, value)
            self.checker.controls.note(replacing, REPLACE_ALL if replace else None)
            logger.warning("live limit of %s set to %s%s", target, value,
                           " in place of every declared rate" if replace else "")
        if concurrency is not None:
            field = slots_field(scope, key)
            self.store.set_control(field, str(concurrency))
            self.checker.controls.note(field, str(concurrency))
            logger.warning("live concurrency limit of %s set to %d", target, concurrency)
        self.lines.wake(scope, key)
        return parsed if rates is not None else ()

    def clear_limit(self, scope: str, key: str | None = None) -> bool:
        """Back to the rates and the concurrency in the code for ``scope`` (or ``key``).
        True if a live limit was set."""
        self._direct_call(scope, key, "1/s", 1, None)
        found = False
        for field in (limit_field(scope, key), slots_field(scope, key), replace_field(scope, key)):
            self.checker.controls.note(field, None)
            found = self.store.clear_control(field) or found
        self.lines.wake(scope, key)  # (the code's limits may be higher: tasks waiting go now)
        return found

    def declared_rates(self, scope: str) -> tuple[tuple[Rate, ...], bool]:
        """The rates this app's tasks of ``scope`` declare (by decorator or rule), and
        whether one of them declares its rates by a callable (known only per call)."""
        declared: set[Rate] = set()
        by_callable = False
        for known, spec in self._known_specs():
            if known == scope:
                if isinstance(spec.rates, tuple):
                    declared.update(spec.rates)
                else:
                    by_callable = True
        return tuple(sorted(declared)), by_callable

    def rates_in_force(self, scope: str, key: str | None = None) -> tuple[Rate, ...]:
        """The rates in force for the calls of ``scope``/``key`` that declare
        :meth:`declared_rates` (read now): those, under the live limit if one is set
        (:func:`.controls.merged_rates`)."""
        return parse_controls(self.store.controls()).rates_of(scope, key, self.declared_rates(scope)[0])

    def live_limit(self, scope: str, key: str | None = None) -> tuple[Rate, ...] | None:
        """The live limit set for exactly ``scope``/``key`` (read now), or None."""
        return parse_controls(self.store.controls()).limits.get(limit_field(scope, key))

    def paused_until(self, scope: str, key: str | None = None) -> float | None:
        """When the pause covering ``scope``/``key`` ends (Unix time), or None."""
        return self._paused_until(parse_controls(self.store.controls()), scope, key)

    def _paused_until(self, controls: ControlSet, scope: str, key: str | None) -> float | None:
        until = controls.paused_until(scope, key)
        if not until or until < self.store.now_us():
            return None
        return _unix(until)

    def live_concurrency(self, scope: str, key: str | None) -> int | None:
        """The live concurrency limit of ``scope``/``key`` as this process last read the
        controls (within CONTROL_REFRESH), or None."""
        return self.checker.controls.concurrency_for(self.store, scope, key)

    def reset(self, scope: str, key: str | None = None) -> bool:
        """Forget every window of ``scope``/``key`` (its line stays: its tasks get a look at
        once, with the room the reset gave). True if there was anything."""
        found = self.store.delete(state_key(self.settings.key_prefix, scope, key)) > 0
        self.lines.wake(scope, key)
        return found

    def reset_keys(self, scope: str) -> list[str | None]:
        """Forget the windows of ``scope`` and of every key of it (found by SCAN, as
        :meth:`statuses` finds them). Returns the keys reset (None: the scope's own)."""
        done: list[str | None] = []
        while True:
            found, more = self.statuses(scope=scope, limit=1000)
            fresh = [st.key for st in found if st.key not in done and st.rates]
            for key in fresh:
                self.reset(scope, key)
                done.append(key)
            if not more or not fresh:
                return done

    def _direct_call(self, scope: str, key: str | None, rates: Any, cost: int | Mapping[str, int],
                     algorithm: str | None) -> BoundCall:
        if not isinstance(scope, str) or not scope:
            raise ConfigurationError(f"scope must be a non-empty string, got {scope!r}")
        if key is not None and not isinstance(key, str):
            raise ConfigurationError(f"key must be a string or None, got {key!r}")
        algorithm = algorithm or self.settings.default_algorithm
        if algorithm not in ALGORITHMS:
            raise ConfigurationError(f"unknown algorithm {algorithm!r}: use one of {ALGORITHMS}")
        parsed = parse_rates(rates)
        by_unit = dict(cost) if isinstance(cost, Mapping) else {"": cost}
        for unit, units in by_unit.items():
            if isinstance(units, bool) or not isinstance(units, int) or units <= 0:
                raise ConfigurationError(f"cost must be a positive integer, got {units!r}")
            if unit and not (isinstance(unit, str) and UNIT_NAME.match(unit) and any(r.unit == unit for r in parsed)):
                raise ConfigurationError(f"cost names unit {unit!r}, which none of the rates "
                                         f"{[str(r) for r in parsed]} counts")
        if not isinstance(cost, Mapping):
            return BoundCall(scope, key, parsed, cost, algorithm, state_key(self.settings.key_prefix, scope, key))
        unit_costs = tuple(sorted(by_unit.items()))
        return BoundCall(scope, key, parsed, rate_costs(parsed, unit_costs), algorithm,
                         state_key(self.settings.key_prefix, scope, key), unit_costs=unit_costs)


def _unix(until_us: int) -> float:
    return float("inf") if until_us >= FOREVER_US else until_us / 1e6


def _decision(reply: WindowReply) -> Decision:
    return Decision(
        allowed=reply.allowed,
        retry_after=0.0 if reply.allowed else reply.wait_us / 1e6,
        remaining=reply.remaining,
        reset_at=(reply.clear_at_us or reply.now_us) / 1e6,
    )
