"""The checks of one call, for the paths that check: the pool's hook (:meth:`Checker.check`),
the consumer's screen (:meth:`Checker.screen`) and publish (:meth:`Checker.admit_at_publish`,
:meth:`Checker.reserve_at_publish`).

A :class:`Checker` binds a task's throttle to one call's arguments (under the live
limits and pauses this process has read), tells the store's window operations what
they need to know of it (a :class:`.protocol.WindowCall`, made once per call shape), and
keeps this process's leases. :class:`.limiter.Throttle` owns one, and the settings and
store connections it works with.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any, Protocol

from . import timing
from .config import Settings
from .controls import Controls
from .errors import ThrottleError
from .keys import encode
from .lease import Leases, sent_at
from .protocol import (
    Code,
    Cost,
    Counted,
    Reservation,
    WindowCall,
    WindowReply,
    per_rate,
    rate_field,
    rates_tag,
)
from .rates import Rate
from .spec import BoundCall, ThrottleSpec, rate_costs
from .store import RedisStore

__all__ = ["Checker"]


class Stores(Protocol):
    """What a checker works with: the settings, and the store by two connections."""

    @property
    def settings(self) -> Settings: ...

    @property
    def store(self) -> RedisStore: ...

    @property
    def quick_store(self) -> RedisStore: ...


class Checker:
    """The checks of one app's throttled calls, in this process."""

    def __init__(self, owner: Stores) -> None:
        self._owner = owner
        #: This process's copy of the pauses and live limits.
        self.controls = Controls()
        self._leases = Leases()
        self._rules: list[tuple[str, ThrottleSpec]] | None = None
        #: What the script is told, by call shape (see _window_call).
        self._requests: dict[tuple[Any, ...], WindowCall] = {}

    def forget(self) -> None:
        """Forget what was read of the settings (they changed)."""
        self._rules = None
        self._requests = {}

    @property
    def settings(self) -> Settings:
        return self._owner.settings

    @property
    def store(self) -> RedisStore:
        return self._owner.store

    @property
    def quick_store(self) -> RedisStore:
        return self._owner.quick_store

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
        settings = self.settings
        declared = spec.bind(name, signature, args or (), kwargs or {}, settings.default_algorithm,
                             settings.key_prefix)
        call = self.live(declared, quick=quick)
        margin = spec.margin if spec.margin is not None else settings.margin
        if call.algorithm == "sliding" and margin != 0:
            margin_us = -1 if margin is None else round(margin * 1_000_000)  # -1: the default, per rate
            rates = _widened(call.rates, margin_us)
            # (A live rate keeps the state of the declared one of its window and unit, both
            # widened alike.)
            fields = None if call.fields is None else _live_fields(call.algorithm, _widened(declared.rates, margin_us),
                                                                   rates)
            call = replace(call, rates=rates, fields=fields)
        return call

    def live(self, call: BoundCall, *, quick: bool = False) -> BoundCall:
        """``call`` under the live limit of its key, else of its scope, if one is set (rates,
        concurrency, or both).

        A live rate of the same window length as a declared one keeps that one's state
        (what was counted and reserved still counts, under the new limit); a window of
        another length starts empty."""
        store = self.quick_store if quick else self.store
        concurrency = self.controls.concurrency_for(store, call.scope, call.key)
        if concurrency is not None and concurrency != call.concurrency:
            call = replace(call, concurrency=concurrency)
        override = self.controls.limits_for(store, call.scope, call.key)
        if override is None or override == call.rates:
            return call
        cost = rate_costs(override, call.unit_costs) if call.unit_costs else call.cost
        return replace(call, rates=override, cost=cost, fields=_live_fields(call.algorithm, call.rates, override))

    def check(self, call: BoundCall, *, reserve: bool, claim: Reservation | None = None,
              claimant: str | None = None, learn: bool = True, lease: bool = False,
              max_wait: float | None = None, resumed: bool = False, early_us: int = 0) -> WindowReply:
        """The worker's check of one bound call: admit it now, or deny it and (if
        ``reserve``) reserve a future start.

        ``claim``: a reservation this call made earlier; ``claimant`` (the task id) makes
        using it single-use; ``learn=False`` for a second claim of one arrival. ``lease``:
        a fresh call may be admitted from, or take, a lease (see :mod:`.lease`).
        ``max_wait`` (seconds): reserve no start further away (the reply's code is then
        ``TOO_FAR``). ``resumed``: ``claim`` was reserved behind a pause lifted since.
        ``early_us``: a claim that comes at most this long before its start is granted
        it (``Code.RUN_AT``: the caller waits for it, then runs).
        """
        key, request = self._window_call(call, self.store, max_wait)
        if claim is not None:
            if claim.rates_tag and claim.rates_tag != rates_tag(call.rates):
                # Reserved under other rates (a live limit set or cleared since): its start
                # is given back and the call checked afresh under the rates of now (the
                # script does that for a claim past its latest start). What it gives back
                # is the call's cost under the rates of now, rate by rate (a count per rate
                # of the old rates would not line up with them).
                claim = replace(claim, latest_us=claim.start_us - 1, cost=call.cost)
            marker = f"{key}:claimed:{encode(claimant)}:{claim.start_us}" if claimant else None
            return self.store.claim(key, request, claim, marker=marker, learn=learn, reserve=reserve,
                                    resumed=resumed, early_us=early_us)
        if not lease or request.not_before_us:  # (a lease would start in a pause)
            return self.store.acquire(key, request, reserve=reserve)
        # A lease holds units of these very rates: a call of the same key under other
        # rates (a callable rate that changed) does not use it. Of rates counting
        # different units it holds calls of one cost per rate, which a call of that very
        # cost uses, one a call (window.lua: a lease of calls).
        of_units = isinstance(call.cost, int)
        leased_as = (key, call.algorithm, call.rates) if of_units else (key, call.algorithm, call.rates, call.cost)
        unit = call.cost if isinstance(call.cost, int) else 1
        if self._leases.take(leased_as, unit, request.slack_us):
            return WindowReply(Code.RUN, 0, -1, 0, 0, 0, 0, 0, -1, 0)
        span = self.lease_span_us(call.rates)
        units = self._leases.wanted(leased_as, unit, span)
        sent = sent_at()
        reply = self.store.acquire(key, request, reserve=reserve, lease=units, lease_span_us=span)
        if reply.leased:
            self._leases.grant(leased_as, reply.leased - unit, max(span, request.slack_us), sent)
        return reply

    def counted(self, call: BoundCall, reply: WindowReply, claim: Reservation | None) -> Counted | None:
        """Where a call that :meth:`check` admitted is counted (None: not admitted): the
        start it reserved, the span it was recorded in now, or (``start_us`` 0, the
        span its slack) a lease of this process."""
        if reply.code not in (Code.RUN, Code.RUN_AT):
            return None
        if not reply.now_us:
            return Counted(0, self.slack_us(call.rates), call.cost, 0)
        if claim is not None and reply.start_us:
            return Counted(claim.start_us, claim.start_us + claim.grace_us, claim.cost, reply.epoch)
        span = self.slack_us(call.rates)
        if reply.leased:
            span = max(self.lease_span_us(call.rates), span)
        return Counted(reply.now_us, reply.now_us + span, call.cost, reply.epoch)

    def settle(self, call: BoundCall, counted: Counted, delta: Cost) -> WindowReply:
        """Count ``delta`` units more (a refund: fewer) for a call that started, counted
        as ``counted`` (see :mod:`.settle`)."""
        key, request = self._window_call(call, self.store, None)
        return self.store.settle(key, request, counted, delta)

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
        not_before = self.controls.paused_until(store, call.scope, call.key)
        # (A store far away: a reserved start must stay open round trips longer, the claim
        # travels to it, however little the window's share.)
        far_us = timing.round_trip_allowance_us(store.rtt_us)
        # The same few shapes come again and again: their WindowCall (and with it the
        # ARGV window_argv builds from it) is made once, not on every check.
        shape = (call.algorithm, call.rates, call.cost, call.fields, max_wait, not_before, min_grace_us, far_us)
        request = self._requests.get(shape)
        if request is None:
            too_costly = _too_costly(call.rates, call.cost)
            if too_costly is not None:
                units, rate = too_costly
                raise ThrottleError(
                    f"cost {units} of scope {call.scope!r} exceeds the limit of its rate {rate}: it can never run"
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
        return call.state_key, request

    def holds(self, call: BoundCall, now_us: int) -> bool:
        """Whether a pause holds ``call`` at ``now_us`` (this process's copy of the
        controls). A task it holds is parked, however short the wait, so that a resume
        can send it at once."""
        return self.pause_end_us(call) > now_us

    def pause_end_us(self, call: BoundCall) -> int:
        """When the pause covering ``call`` ends (µs, Redis clock; this process's copy of
        the controls), or 0."""
        return self.controls.paused_until(self.store, call.scope, call.key)

    def pause_end_of(self, scope: str, key: str | None) -> int:
        """When the pause covering ``scope``/``key`` ends (µs, Redis clock; this process's
        copy of the controls), or 0."""
        return self.controls.paused_until(self.store, scope, key)

    def pauses(self) -> dict[str, int]:
        """This process's copy of the pauses: control field to end (µs, Redis clock)."""
        return self.controls.pauses(self.store)

    def refresh_controls(self) -> None:
        """Read pauses and live limits now (a task held by a pause arrives: is it over?)."""
        self.controls.refresh(self.store)


#: Call shapes whose WindowCall a Checker keeps (rates, cost, max wait, pause end).
_REQUEST_SHAPES = 1024


def _too_costly(rates: tuple[Rate, ...], cost: Cost) -> tuple[int, Rate] | None:
    """(units, rate) of a rate that ``cost`` never fits in, or None."""
    for rate, units in zip(rates, per_rate(cost, len(rates))):
        if units > rate.limit:
            return units, rate
    return None


@lru_cache(maxsize=1024)
def _widened(rates: tuple[Rate, ...], margin_us: int) -> tuple[Rate, ...]:
    """Each rate's window made ``margin_us`` longer (a window of its own in the state);
    -1: by the default margin of its length (:func:`.timing.default_margin_us`)."""
    return tuple(Rate(r.limit, (r.period_us + (margin_us if margin_us >= 0 else timing.default_margin_us(r.period_us)))
                      / 1_000_000, r.unit) for r in rates)


@lru_cache(maxsize=1024)
def _live_fields(algorithm: str, declared: tuple[Rate, ...], live: tuple[Rate, ...]) -> tuple[str, ...]:
    """The state field of each live rate: the declared rate's of the same window length
    and unit, else its own."""
    by_period = {(r.period_us, r.unit): r for r in declared}
    return tuple(rate_field(algorithm, by_period.get((r.period_us, r.unit), r)) for r in live)
