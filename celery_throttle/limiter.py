"""The Throttle controller: the limiter as users call it, and what the task hook uses."""

from __future__ import annotations

import fnmatch
import inspect
import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from . import timing
from .config import ALGORITHMS, Settings, require_redis_url
from .controls import FOREVER_US, Controls, control_target, limit_field, parse_controls, pause_field
from .errors import ConfigurationError, ThrottleError
from .hints import Hints
from .keys import encode, parked_patterns, scan_pattern, state_key, state_of, target_matches
from .lease import Leases, sent_at
from .metrics import Metrics
from .parking_store import ParkingStore
from .protocol import ALGORITHM_TAGS, Code, Reservation, WindowCall, WindowReply, rate_field, rates_tag
from .rates import Rate, parse_rates
from .spec import BoundCall, ThrottleSpec, declared_spec
from .store import RedisStore

__all__ = ["Decision", "RateStatus", "Status", "Throttle"]

_ALGORITHM_OF_TAG = {tag: algorithm for algorithm, tag in ALGORITHM_TAGS.items()}

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
    #: Tasks held back at publish (by the window or a pause), counted until a day passes
    #: without one (``ScriptPolicy.held_count_ttl_ms``).
    held_at_publish: int = 0

    @property
    def remaining(self) -> int | None:
        return min((r.remaining for r in self.rates), default=None)


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
        self._lock = threading.Lock()
        self._rules: list[tuple[str, ThrottleSpec]] | None = None
        self._leases = Leases()
        self._controls = Controls()
        self._metrics: Metrics | None = None
        #: What this process may send unchecked at publish (see :mod:`.publish`).
        self.hints = Hints()
        #: The store's run id as last seen (a change: the store restarted), or None.
        self.store_run_id: str | None = None
        #: What the script is told, by call shape (see _window_call).
        self._requests: dict[tuple[Any, ...], WindowCall] = {}
        #: Where long waits go in the broker (:func:`.broker_parking.broker_parking`), once
        #: looked at; False: in the store.
        self.broker_parking: Any = None

    # -- configuration ----------------------------------------------------------------
    def configure(self, overrides: Mapping[str, Any]) -> None:
        """Apply more overrides (``install`` called again with settings)."""
        with self._lock:
            self._overrides.update(overrides)
            self._settings = None
            self._rules = None
            self._requests = {}
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

    def max_wait(self, spec: ThrottleSpec) -> float | None:
        """The longest a denied call of ``spec`` may wait (seconds), or None."""
        return spec.max_wait if spec.max_wait is not None else self.settings.max_wait

    def rule_for(self, task_name: str) -> ThrottleSpec | None:
        """The first ``throttle_rules`` entry whose glob matches ``task_name``."""
        if self._rules is None:
            self._rules = [
                (pattern, ThrottleSpec.from_rule(pattern, options))
                for pattern, options in self.settings.rules.items()
            ]
        for pattern, spec in self._rules:
            if fnmatch.fnmatchcase(task_name, pattern):
                return spec
        return None

    def rule_pattern(self, task_name: str) -> str | None:
        """The glob of the first rule matching ``task_name``, or None."""
        return next((p for p in self.settings.rules if fnmatch.fnmatchcase(task_name, p)), None)

    # -- the limiter ------------------------------------------------------------------
    def grace_us(self, rates: Sequence[Rate]) -> int:
        """How long after its reserved start a deferred task may still use it (µs); see
        :func:`.timing.grace_us`."""
        return timing.grace_us(tuple(rates), self.settings.start_grace)

    def lead_us(self, rates: Sequence[Rate], learnt: int = -1) -> int:
        """How early a reserved task is sent back (µs); see :func:`.timing.lead_us`. Half
        a round trip to the store more when it is far: its claim must reach the store
        before the start (and every µs earlier holds a pool process)."""
        return (timing.lead_us(rates, self.grace_us(rates), learnt)
                + timing.round_trip_allowance_us(self.store.rtt_us) // 2)

    @staticmethod
    def slack_us(rates: Sequence[Rate]) -> int:
        """See :func:`.timing.slack_us`."""
        return timing.slack_us(rates)

    @staticmethod
    def lease_span_us(rates: Sequence[Rate]) -> int:
        """See :func:`.timing.lease_span_us`."""
        return timing.lease_span_us(rates)

    def bind(self, task: Any, args: Any, kwargs: Any, *, quick: bool = False) -> BoundCall:
        """The limit of one call of a hooked task: its throttle bound to the arguments,
        under the live limit of its scope or key if one is set."""
        return self.bind_spec(task.name, type(task)._throttle_spec, type(task)._throttle_signature,
                              args, kwargs, quick=quick)

    def bind_spec(self, name: str, spec: ThrottleSpec, signature: inspect.Signature | None, args: Any,
                  kwargs: Any, *, quick: bool = False) -> BoundCall:
        """As :meth:`bind`, for task ``name`` throttled by ``spec``, whose arguments bind
        to ``signature`` (None: unknown, a key is built from keyword arguments only)."""
        call = self.live(spec.bind(name, signature, args or (), kwargs or {}, self.settings.default_algorithm),
                         quick=quick)
        margin = spec.margin if spec.margin is not None else self.settings.margin
        if call.algorithm == "sliding" and margin != 0:
            margin_us = -1 if margin is None else round(margin * 1_000_000)  # -1: the default, per rate
            call = replace(call, rates=_widened(call.rates, margin_us), fields=None)
        return call

    def live(self, call: BoundCall, *, quick: bool = False) -> BoundCall:
        """``call`` under the live limit of its key, else of its scope, if one is set.

        A live rate of the same window length as a declared one keeps that one's state
        (what was counted and reserved still counts, under the new limit); a window of
        another length starts empty."""
        override = self._controls.limits_for(self.quick_store if quick else self.store, call.scope, call.key)
        if override is None or override == call.rates:
            return call
        return replace(call, rates=override, fields=_live_fields(call.algorithm, call.rates, override))

    def check(self, call: BoundCall, *, reserve: bool, claim: Reservation | None = None,
              claimant: str | None = None, learn: bool = True, lease: bool = False,
              max_wait: float | None = None, resumed: bool = False) -> WindowReply:
        """The worker's check of one bound call: admit it now, or deny it and (if
        ``reserve``) reserve a future start.

        ``claim``: a reservation this call made earlier; ``claimant`` (the task id) makes
        using it single-use; ``learn=False`` for a second claim of one arrival. ``lease``:
        a fresh call may be admitted from, or take, a lease (see :mod:`.lease`).
        ``max_wait`` (seconds): reserve no start further away (the reply's code is then
        ``TOO_FAR``). ``resumed``: ``claim`` was reserved behind a pause lifted since.
        """
        key, request = self._window_call(call, self.store, max_wait)
        if claim is not None:
            if claim.rates_tag and claim.rates_tag != rates_tag(call.rates):
                # Reserved under other rates (a live limit set or cleared since): its start
                # is given back and the call checked afresh under the rates of now (the
                # script does that for a claim past its latest start).
                claim = replace(claim, latest_us=claim.start_us - 1)
            marker = f"{key}:claimed:{encode(claimant)}:{claim.start_us}" if claimant else None
            return self.store.claim(key, request, claim, marker=marker, learn=learn, reserve=reserve,
                                    resumed=resumed)
        if not lease or request.not_before_us:  # (a lease would start in a pause)
            return self.store.acquire(key, request, reserve=reserve)
        # A lease holds units of these very rates: a call of the same key under other
        # rates (a callable rate that changed) does not use it.
        leased_as = (key, call.algorithm, call.rates)
        if self._leases.take(leased_as, call.cost, request.slack_us):
            return WindowReply(Code.RUN, 0, -1, 0, 0, 0, 0, 0, -1, 0)
        span = self.lease_span_us(call.rates)
        units = self._leases.wanted(leased_as, call.cost, span)
        sent = sent_at()
        reply = self.store.acquire(key, request, reserve=reserve, lease=units, lease_span_us=span)
        if reply.leased:
            self._leases.grant(leased_as, reply.leased - call.cost, max(span, request.slack_us), sent)
        return reply

    def screen(self, call: BoundCall, *, max_wait: float | None = None) -> WindowReply:
        """The consumer's check of a message before it goes to the pool: as :meth:`check`
        with ``reserve``, but a call that fits now is not recorded (the pool's check
        does that). On a connection of its own with a short timeout."""
        key, request = self._window_call(call, self.quick_store, max_wait)
        return self.quick_store.screen(key, request, reserve=True)

    def admit_at_publish(self, call: BoundCall, *, max_wait: float | None = None) -> WindowReply:
        """The producer's check of a task about to be sent: ``RUN`` (nothing recorded) if
        the key has room, with the room left in ``leased`` (see :mod:`.publish`), else as
        :meth:`reserve_at_publish`. Quick, like :meth:`screen`."""
        key, request = self._window_call(call, self.quick_store, max_wait, timing.PUBLISH_GRACE_US)
        return self.quick_store.admit(key, request)

    def reserve_at_publish(self, call: BoundCall, *, max_wait: float | None = None) -> WindowReply:
        """The producer's check of a task about to be sent: a start is reserved even if
        the call fits now (the worker claims it). Quick, like :meth:`screen`."""
        key, request = self._window_call(call, self.quick_store, max_wait, timing.PUBLISH_GRACE_US)
        return self.quick_store.reserve(key, request)

    def _window_call(self, call: BoundCall, store: RedisStore, max_wait: float | None,
                     min_grace_us: int = 0) -> tuple[str, WindowCall]:
        """The state key of ``call`` and what the script is told about it (``min_grace_us``:
        the least grace its reservation gets)."""
        not_before = self._controls.paused_until(store, call.scope, call.key)
        # (A store far away: a reserved start must stay open round trips longer, the claim
        # travels to it, however little the window's share.)
        far_us = timing.round_trip_allowance_us(store.rtt_us)
        # The same few shapes come again and again: their WindowCall (and with it the
        # ARGV window_argv builds from it) is made once, not on every check.
        shape = (call.algorithm, call.rates, call.cost, call.fields, max_wait, not_before, min_grace_us, far_us)
        request = self._requests.get(shape)
        if request is None:
            tightest = _tightest_limit(call.rates)
            if call.cost > tightest:
                raise ThrottleError(
                    f"cost {call.cost} of scope {call.scope!r} exceeds the limit {tightest} of one of its rates"
                )
            request = WindowCall(
                call.algorithm, call.rates, call.cost, call.fields,
                grace_us=timing.reservation_grace_us(call.rates, self.settings.start_grace, min_grace_us, far_us),
                slack_us=self.slack_us(call.rates), max_wait_us=int(max_wait * 1_000_000) if max_wait else 0,
                not_before_us=not_before, pause_horizon_us=int(self.settings.park_after * 1_000_000),
            )
            if len(self._requests) >= _REQUEST_SHAPES:
                self._requests.clear()  # (callable rates or costs without end: start over)
            self._requests[shape] = request
        return state_key(self.settings.key_prefix, call.scope, call.key), request

    def acquire(
        self,
        scope: str,
        key: str | None = None,
        rates: str | Sequence[str] = (),
        cost: int = 1,
        algorithm: str | None = None,
    ) -> Decision:
        """Consume ``cost`` units of ``scope`` (and ``key``) now if every rate admits it.

        A denial consumes nothing. ``retry_after`` says when the same call would fit.
        """
        call = self.live(self._direct_call(scope, key, rates, cost, algorithm))
        reply = self.check(call, reserve=False)
        return _decision(reply)

    def status(self, scope: str, key: str | None = None) -> Status:
        """Usage of every rate stored for ``scope``/``key``, consuming nothing."""
        pauses, limits = parse_controls(self.store.controls())
        return self._status(scope, key, pauses, limits)

    def statuses(self, match: str = "*", limit: int = 200, scope: str | None = None,
                 key_match: str | None = None) -> tuple[list[Status], bool]:
        """The status of every scope and key that Redis holds a window, a pause or a live
        limit for, whose scope matches the glob ``match`` and key the glob ``key_match``
        (:func:`.keys.target_matches`; and, if given, whose scope is ``scope``); found by
        SCAN, never KEYS. At most ``limit`` of them; the flag is True if more were left."""
        prefix = self.settings.key_prefix
        pauses, limits = parse_controls(self.store.controls())
        found: dict[tuple[str, str | None], None] = {}
        more = False
        named = (state_of(prefix, name) for name in self.store.scan(scan_pattern(prefix)))
        controlled = (control_target(field) for field in (*pauses, *limits))
        for target in itertools.chain(controlled, named):
            if (target is None or target in found or not target_matches(*target, match, key_match)
                    or (scope is not None and target[0] != scope)):
                continue
            if len(found) >= limit:
                more = True
                break
            found[target] = None
        ordered = sorted(found, key=lambda t: (t[0], t[1] is not None, t[1] or ""))
        return [self._status(scope, key, pauses, limits) for scope, key in ordered], more

    def known_scopes(self) -> list[str]:
        """The scopes this app's throttled tasks use (declared or by rule; a scope that
        is the task's name where none is given)."""
        return sorted({scope for scope, _ in self._known_specs()})

    def _known_specs(self) -> list[tuple[str, ThrottleSpec]]:
        """(scope, throttle) of every throttled task of this app, declared or by rule."""
        out = []
        for name, task in list(self.app.tasks.items()):
            spec = declared_spec(task) or (None if name.startswith("celery.") else self.rule_for(name))
            if spec is not None:
                out.append((spec.scope or name, spec))
        return out

    def _declared_periods(self, scope: str, live_rates: Sequence[Rate]) -> set[int]:
        """The window lengths (µs) declared for ``scope``: by its tasks' fixed rates, and
        its live limit."""
        periods = {r.period_us for r in live_rates}
        for known, spec in self._known_specs():
            if known == scope and isinstance(spec.rates, tuple):
                periods.update(r.period_us for r in spec.rates)
        return periods

    def _status(self, scope: str, key: str | None, pauses: Mapping[str, int],
                limits: Mapping[str, tuple[Rate, ...]]) -> Status:
        hash_key = state_key(self.settings.key_prefix, scope, key)
        live_rates = (key is not None and limits.get(limit_field(scope, key))) or limits.get(limit_field(scope, None))
        live = {r.period_us: r for r in live_rates or ()}
        seen: set[tuple[str, Rate, Rate, str]] = set()
        declared = self._declared_periods(scope, live_rates or ())
        for field in self.store.read(hash_key):
            algorithm = _ALGORITHM_OF_TAG.get(field[:1])
            limit, _, period_us = field[1:].partition("/")
            if algorithm and limit.isdigit() and period_us.isdigit():
                # Shown as declared (a window with the default margin as the rate without
                # it), counted over the window stored. The limit in force: the live one
                # of this window length, if set.
                stored_us = int(period_us)
                declared_us = next((d for d in declared if d + timing.default_margin_us(d) == stored_us
                                    and algorithm == "sliding"), stored_us)
                rate = live.get(declared_us) or Rate(int(limit), declared_us / 1_000_000)
                seen.add((algorithm, rate, Rate(rate.limit, stored_us / 1_000_000), field))
        out = []
        for algorithm, rate, counted, field in sorted(seen):
            reply = self.store.peek(hash_key, WindowCall(algorithm, (counted,), fields=(field,)))
            used = rate.limit - reply.remaining
            reset_at = (reply.clear_at_us or reply.now_us) / 1e6
            out.append(RateStatus(rate, algorithm, used, reply.remaining, reset_at))
        return Status(scope, key, tuple(out), self._paused_until(pauses, scope, key), live_rates or None,
                      self.store.held_count(hash_key))

    def pause(self, scope: str, key: str | None = None, seconds: float | None = None) -> float:
        """Start nothing of ``scope`` (or of its ``key``) for ``seconds`` (None: until
        :meth:`resume`), on every worker within CONTROL_REFRESH. Tasks that arrive are
        reserved a start after the pause (parked if it is long), never failed by it; tasks
        already waiting whose start falls in it are reserved again after it. A longer
        pause already set stays. Returns when it ends (Unix time; ``inf``: never)."""
        self._direct_call(scope, key, "1/s", 1, None)  # (validates scope and key)
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not 0 < seconds < 10 * 365 * 86400):
            raise ConfigurationError(f"pause seconds must be a positive number (or None: until resumed), "
                                     f"got {seconds!r}")
        field = pause_field(scope, key)
        until = self.store.pause(field, seconds)
        self._controls.note(field, str(until))
        logger.warning("paused scope %r%s %s", scope, "" if key is None else f" key {key!r}",
                       "until resumed" if until == FOREVER_US else f"for {seconds:.1f}s")
        return _unix(until)

    def resume(self, scope: str, key: str | None = None) -> bool:
        """End a pause of ``scope`` (or of its ``key``) now. True if there was one.

        Every task the pause held is parked (see :meth:`holds`): those of this scope (or
        key) are made due now and a worker's releaser is woken to send them at once (the
        workers send them, with their own app's routing, not this process). The worker
        that gets one checks it afresh: the pause is over."""
        self._direct_call(scope, key, "1/s", 1, None)
        field = pause_field(scope, key)
        self._controls.note(field, None)
        found = self.store.clear_control(field)
        due = self.parking.hasten(parked_patterns(scope, key), self.store.now_us())
        if due or found:  # (found: it may hold tasks in the broker's held queue, uncounted)
            self.parking.wake_releasers()
            logger.warning("resumed scope %r%s: %d parked task(s) it held are due now", scope,
                           "" if key is None else f" key {key!r}", due)
        return found

    def holds(self, call: BoundCall, now_us: int) -> bool:
        """Whether a pause holds ``call`` at ``now_us`` (this process's copy of the
        controls). A task it holds is parked, however short the wait, so that a resume
        can send it at once."""
        return self.pause_end_us(call) > now_us

    def pause_end_us(self, call: BoundCall) -> int:
        """When the pause covering ``call`` ends (µs, Redis clock; this process's copy of
        the controls), or 0."""
        return self._controls.paused_until(self.store, call.scope, call.key)

    def pause_end_of(self, scope: str, key: str | None) -> int:
        """When the pause covering ``scope``/``key`` ends (µs, Redis clock; this process's
        copy of the controls), or 0."""
        return self._controls.paused_until(self.store, scope, key)

    def pauses(self) -> dict[str, int]:
        """This process's copy of the pauses: control field to end (µs, Redis clock)."""
        return self._controls.pauses(self.store)

    def refresh_controls(self) -> None:
        """Read pauses and live limits now (a task held by a pause arrives: is it over?)."""
        self._controls.refresh(self.store)

    def set_limit(self, scope: str, rates: str | Sequence[str], key: str | None = None) -> tuple[Rate, ...]:
        """Limit ``scope`` (every key of it that has no limit of its own, or only ``key``)
        to ``rates`` instead of what the code declares, on every worker within
        CONTROL_REFRESH, until :meth:`clear_limit`. Starts already reserved keep their
        time if they still fit; those that do not under the new rates (a lowered limit)
        are reserved again when their task arrives. Returns the rates set."""
        parsed = self._direct_call(scope, key, rates, 1, None).rates
        field, value = limit_field(scope, key), ",".join(map(str, parsed))
        self.store.set_control(field, value)
        self._controls.note(field, value)
        logger.warning("live limit of scope %r%s set to %s", scope, "" if key is None else f" key {key!r}", value)
        return parsed

    def clear_limit(self, scope: str, key: str | None = None) -> bool:
        """Back to the rates in the code for ``scope`` (or ``key``). True if one was set."""
        self._direct_call(scope, key, "1/s", 1, None)
        field = limit_field(scope, key)
        self._controls.note(field, None)
        return self.store.clear_control(field)

    def live_limit(self, scope: str, key: str | None = None) -> tuple[Rate, ...] | None:
        """The live limit set for exactly ``scope``/``key`` (read now), or None."""
        _, limits = parse_controls(self.store.controls())
        return limits.get(limit_field(scope, key))

    def paused_until(self, scope: str, key: str | None = None) -> float | None:
        """When the pause covering ``scope``/``key`` ends (Unix time), or None."""
        pauses, _ = parse_controls(self.store.controls())
        return self._paused_until(pauses, scope, key)

    def _paused_until(self, pauses: Mapping[str, int], scope: str, key: str | None) -> float | None:
        until = max(pauses.get(pause_field(scope, None), 0),
                    pauses.get(pause_field(scope, key), 0) if key is not None else 0)
        if not until or until < self.store.now_us():
            return None
        return _unix(until)

    def reset(self, scope: str, key: str | None = None) -> bool:
        """Forget every window of ``scope``/``key``. True if there was anything."""
        return self.store.delete(state_key(self.settings.key_prefix, scope, key)) > 0

    def _direct_call(self, scope: str, key: str | None, rates: Any, cost: int, algorithm: str | None) -> BoundCall:
        if not isinstance(scope, str) or not scope:
            raise ConfigurationError(f"scope must be a non-empty string, got {scope!r}")
        if key is not None and not isinstance(key, str):
            raise ConfigurationError(f"key must be a string or None, got {key!r}")
        algorithm = algorithm or self.settings.default_algorithm
        if algorithm not in ALGORITHMS:
            raise ConfigurationError(f"unknown algorithm {algorithm!r}: use one of {ALGORITHMS}")
        parsed = parse_rates(rates)
        if isinstance(cost, bool) or not isinstance(cost, int) or cost <= 0:
            raise ConfigurationError(f"cost must be a positive integer, got {cost!r}")
        return BoundCall(scope, key, parsed, cost, algorithm)


#: Call shapes whose WindowCall a Throttle keeps (rates, cost, max wait, pause end).
_REQUEST_SHAPES = 1024


@lru_cache(maxsize=1024)
def _tightest_limit(rates: tuple[Rate, ...]) -> int:
    return min(r.limit for r in rates)


@lru_cache(maxsize=1024)
def _widened(rates: tuple[Rate, ...], margin_us: int) -> tuple[Rate, ...]:
    """Each rate's window made ``margin_us`` longer (a window of its own in the state);
    -1: by the default margin of its length (:func:`.timing.default_margin_us`)."""
    return tuple(Rate(r.limit, (r.period_us + (margin_us if margin_us >= 0 else timing.default_margin_us(r.period_us)))
                      / 1_000_000) for r in rates)


@lru_cache(maxsize=1024)
def _live_fields(algorithm: str, declared: tuple[Rate, ...], live: tuple[Rate, ...]) -> tuple[str, ...]:
    """The state field of each live rate: the declared rate's of the same window length,
    else its own."""
    by_period = {r.period_us: r for r in declared}
    return tuple(rate_field(algorithm, by_period.get(r.period_us, r)) for r in live)


def _unix(until_us: int) -> float:
    return float("inf") if until_us >= FOREVER_US else until_us / 1e6


def _decision(reply: WindowReply) -> Decision:
    return Decision(
        allowed=reply.allowed,
        retry_after=0.0 if reply.allowed else reply.wait_us / 1e6,
        remaining=reply.remaining,
        reset_at=(reply.clear_at_us or reply.now_us) / 1e6,
    )
