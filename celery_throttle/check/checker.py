"""The checks of one call, for the paths that check: the pool's hook (:meth:`Checker.acquire`,
:meth:`Checker.claim`), the consumer's screen (:meth:`Checker.screen`), publish
(:meth:`Checker.admit`), and what a line needs done (release, settle, a slot's end).

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
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..celery_parts.internals import registered_task
from ..core import timing
from ..core.config import Settings
from ..core.cost import rate_costs
from ..core.errors import ThrottleError
from ..core.protocol import NO_ENTRY, Code, Cost, Counted, Entry, WindowCall, WindowReply, per_rate
from ..core.rates import Rate
from ..core.spec import BoundCall, ThrottleSpec, declared_spec
from ..core.state import rate_field
from ..store.client import RedisStore
from .controls import Controls
from .lease import Leases, sent_at

if TYPE_CHECKING:
    from .metrics import Metrics

__all__ = ["Checker", "Known"]


class Stores(Protocol):
    """What a checker works with: the settings, and the store by two connections."""

    @property
    def settings(self) -> Settings: ...

    @property
    def store(self) -> RedisStore: ...

    @property
    def quick_store(self) -> RedisStore: ...


class Owner(Stores, Protocol):
    """What this process's side of the lines and slots works with: the app's ``Throttle``
    (which owns them), seen as its checks, store and metrics. (A protocol, not the
    controller's class, which imports them.)"""

    @property
    def checker(self) -> Checker: ...

    @property
    def metrics(self) -> Metrics: ...


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

    def known(self, app: Any, name: str, task: Any) -> Known | None:
        """The throttle ``app`` knows for task ``name`` (``task``: its task, if the caller
        has it): a ``@throttle`` on its task, else a rule; None if it has none."""
        if task is None:
            task = registered_task(app, name)
        spec = declared_spec(task) if task is not None else None
        if spec is None:
            spec = self.rule_for(name) if not name.startswith("celery.") else None
        if spec is None:
            return None
        return Known(spec, _call_signature(task) if task is not None else None, task)

    def rule_pattern(self, task_name: str) -> str | None:
        """The glob of the first rule matching ``task_name``, or None."""
        return next((p for p in self.settings.rules if fnmatch.fnmatchcase(task_name, p)), None)

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
        return self.finish_bind(declared, spec.margin, quick=quick)

    def finish_bind(self, declared: BoundCall, margin: float | None, *, quick: bool = False) -> BoundCall:
        """A call bound as declared, under the live limits, each sliding window widened by
        ``margin`` (None: ``throttle_margin``): a task's call and a direct ``acquire`` of the
        same scope and rates count in the same fields."""
        call = self.live(declared, quick=quick)
        margin = margin if margin is not None else self.settings.margin
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

        A live rate of the same window length as a declared one takes its place and keeps
        its state (what was counted and reserved still counts, under the new limit); a
        window of another length starts empty; a declared rate of a window the live limit
        does not set stays in force, unless it replaces them all (:func:`.controls.merged_rates`)."""
        store = self.quick_store if quick else self.store
        concurrency = self.controls.concurrency_for(store, call.scope, call.key)
        if concurrency is not None and concurrency != call.concurrency:
            call = replace(call, concurrency=concurrency)
        override = self.controls.rates_for(store, call.scope, call.key, call.rates)
        if override == call.rates:
            return call
        cost = rate_costs(override, call.unit_costs) if call.unit_costs else call.cost
        return replace(call, rates=override, cost=cost, fields=_live_fields(call.algorithm, call.rates, override))

    def with_live_concurrency(self, call: BoundCall) -> BoundCall:
        """``call`` under the concurrency limit in force now (a live K set or cleared since
        it was bound)."""
        live = self.controls.concurrency_for(self.store, call.scope, call.key)
        concurrency = call.declared_concurrency if live is None else live
        return call if concurrency == call.concurrency else replace(call, concurrency=concurrency)

    def acquire(self, call: BoundCall, *, holder: str = "", entry: Entry = NO_ENTRY, lease: bool = False,
                store: RedisStore | None = None) -> WindowReply:
        """A fresh call: run it now if nobody waits and it fits (``RUN``), else it waits in
        its key's line with ``entry``'s message (``QUEUED``; ``DENIED`` without one).
        ``holder``: the delivery that takes a slot, with a concurrency limit. ``lease``: a
        call that fits may be admitted from, or take, a lease (see :mod:`.lease`)."""
        store = store or self.store
        key, request = self._window_call(call, store)
        if not lease or request.not_before_us or request.concurrency or not call.rates:
            return store.acquire(key, request, holder=holder, entry=entry)
        # A lease holds units of these very rates: a call of the same key under other
        # rates (a callable rate that changed) does not use it. Of rates counting
        # different units it holds calls of one cost per rate, which a call of that very
        # cost uses, one a call (window.lua: a lease of calls).
        of_units = isinstance(call.cost, int)
        leased_as = (key, call.algorithm, call.rates) if of_units else (key, call.algorithm, call.rates, call.cost)
        unit = call.cost if isinstance(call.cost, int) else 1
        if self._leases.take(leased_as, unit, request.slack_us):
            return WindowReply(Code.RUN, 0, -1, 0, 0, 0)
        span = self.lease_span_us(call.rates)
        units = self._leases.wanted(leased_as, unit, span)
        sent = sent_at()
        reply = store.acquire(key, request, lease=units, lease_span_us=span, holder=holder, entry=entry)
        if reply.leased:
            self._leases.grant(leased_as, reply.leased - unit, max(span, request.slack_us), sent)
        return reply

    def claim(self, call: BoundCall, ticket: str, *, holder: str = "", entry: Entry = NO_ENTRY,
              granted_us: int = 0, stale_ok: bool = False) -> WindowReply:
        """A released task arrives with its ``ticket``: ``RUN``; ``RUN_AT`` a little early
        (the caller waits for its start, then runs); back in its place in the line
        (``QUEUED``) when the room it was released into is gone; ``WAITED`` past its max
        wait. An unknown ticket is a fresh call (``holder``, ``entry``). ``granted_us``:
        the start granted to this process before, which it woke too late for. ``stale_ok``:
        ``STALE`` rather than back in its place if it was released under other controls
        than this process's copy (read them again, bind the call anew, claim again)."""
        key, request = self._window_call(call, self.store)
        return self.store.claim(key, request, ticket, early_us=timing.WAIT_HERE_MAX_US, holder=holder,
                                granted_us=granted_us, entry=entry, stale_ok=stale_ok)

    def counted(self, call: BoundCall, reply: WindowReply) -> Counted | None:
        """Where a call that :meth:`acquire` or :meth:`claim` admitted is counted (None: not
        admitted): the start it was given, the span it was recorded in now, or (``start_us``
        0, the span its slack) a lease of this process."""
        if reply.code not in (Code.RUN, Code.RUN_AT):
            return None
        if not reply.now_us:
            return Counted(0, self.slack_us(call.rates), call.cost, 0)
        if reply.start_us:
            return Counted(reply.start_us, reply.latest_us, call.cost, reply.epoch)
        span = self.slack_us(call.rates)
        if reply.leased:
            span = max(self.lease_span_us(call.rates), span)
        return Counted(reply.now_us, reply.now_us + span, call.cost, reply.epoch)

    def settle(self, call: BoundCall, counted: Counted, delta: Cost) -> WindowReply:
        """Count ``delta`` units more (a refund: fewer) for a call that started, counted
        as ``counted`` (see :mod:`.settle`)."""
        key, request = self._window_call(call, self.store)
        return self.store.settle(key, request, counted, delta, timing.WORKER_BATCH)

    def screen(self, call: BoundCall, entry: Entry = NO_ENTRY) -> WindowReply:
        """The consumer's check of a message before it goes to the pool: as :meth:`acquire`,
        but a call that fits is not recorded (the pool's check does that). On a
        connection of its own with a short timeout."""
        key, request = self._window_call(call, self.quick_store)
        return self.quick_store.screen(key, request, entry)

    def admit(self, call: BoundCall, entry: Entry) -> WindowReply:
        """The producer's check of a task about to be sent: ``RUN`` (nothing recorded) if
        nothing waits and every rate stays at most half full (the room in ``leased``, see
        :mod:`.publish`); ``RELEASED`` if it fits now (send it with ``entry.id`` as its
        ticket); else as :meth:`acquire`. Quick, like :meth:`screen`."""
        key, request = self._window_call(call, self.quick_store)
        return self.quick_store.admit(key, request, entry)

    def front(self, call: BoundCall, entry: Entry) -> WindowReply:
        """``entry`` joins its key's line before everyone (a task that backs off)."""
        key, request = self._window_call(call, self.store)
        return self.store.front(key, request, entry)

    def release(self, call: BoundCall, batch: int, *, drain: bool = False) -> WindowReply:
        """Release the heads of ``call``'s line that fit (``drain``: whatever the room)."""
        key, request = self._window_call(call, self.store)
        return (self.store.drain if drain else self.store.release)(key, request, batch)

    def ack(self, call: BoundCall, tickets: Sequence[str]) -> WindowReply:
        key, request = self._window_call(call, self.store)
        return self.store.ack(key, request, tickets)

    def give_back(self, call: BoundCall, ticket: str) -> WindowReply:
        """The task released with ``ticket`` will not start (expired, revoked)."""
        key, request = self._window_call(call, self.store)
        return self.store.give_back(key, request, ticket, timing.WORKER_BATCH)

    def ended(self, call: BoundCall, holder: str) -> WindowReply:
        """``holder``'s body ended: its slot goes to the line's head."""
        key, request = self._window_call(call, self.store)
        return self.store.ended(key, request, holder, timing.WORKER_BATCH)

    def renew(self, call: BoundCall, holders: Sequence[str]) -> WindowReply:
        key, request = self._window_call(call, self.store)
        return self.store.renew(key, request, holders)

    def drop(self, call: BoundCall, entries: Sequence[str]) -> WindowReply:
        key, request = self._window_call(call, self.store)
        return self.store.drop(key, request, entries)

    def peek(self, call: BoundCall) -> WindowReply:
        key, request = self._window_call(call, self.store)
        return self.store.peek(key, request)

    def _window_call(self, call: BoundCall, store: RedisStore) -> tuple[str, WindowCall]:
        """The state key of ``call`` and what the script is told about it."""
        not_before = self.controls.paused_until(store, call.scope, call.key)
        # (A store far away: tasks are released a round trip earlier, the reply and the
        # claim each travel half of one.)
        far_us = timing.round_trip_allowance_us(store.rtt_us)
        # The same few shapes come again and again: their WindowCall (and with it the
        # ARGV head it builds) is made once, not on every check.
        shape = (call.algorithm, call.rates, call.cost, call.fields, call.concurrency, not_before, far_us)
        request = self._requests.get(shape)
        if request is None:
            too_costly = _too_costly(call.rates, call.cost)
            if too_costly is not None:
                units, rate = too_costly
                raise ThrottleError(f"cost {units} of scope {call.scope!r} exceeds the limit of its rate "
                                    f"{timing.as_declared(rate)}: it can never run")
            request = WindowCall(
                call.algorithm, call.rates, call.cost, call.fields, slack_us=self.slack_us(call.rates),
                not_before_us=not_before, concurrency=call.concurrency,
                slot_lease_us=int(self.settings.concurrency_lease * 1_000_000),
                lead_us=timing.release_lead_us(call.rates, far_us),
            )
            if len(self._requests) >= _REQUEST_SHAPES:
                self._requests.clear()  # (callable rates or costs without end: start over)
            self._requests[shape] = request
        return call.state_key, request

    def pause_end_of(self, scope: str, key: str | None) -> int:
        """When the pause covering ``scope``/``key`` ends (µs, Redis clock; this process's
        copy of the controls), or 0."""
        return self.controls.paused_until(self.store, scope, key)

    def pauses(self) -> dict[str, int]:
        """This process's copy of the pauses: control field to end (µs, Redis clock)."""
        return self.controls.pauses(self.store)

    def refresh_controls(self) -> bool:
        """Read pauses and live limits now (a task held by a pause arrives: is it over?).
        True if they changed."""
        return self.controls.refresh(self.store)


class Known(NamedTuple):
    """The throttle an app knows for a task name."""

    spec: ThrottleSpec
    #: What its arguments bind to (None: this process does not have the task).
    signature: inspect.Signature | None
    #: The task, or None.
    task: Any


def _call_signature(task: Any) -> inspect.Signature | None:
    """What the arguments of a call of ``task`` bind to: its ``run`` as the task calls it
    (for ``bind=True``, without ``self``), once per task class."""
    cls = type(task)
    if "_throttle_call_signature" not in cls.__dict__:
        try:
            cls._throttle_call_signature = inspect.signature(task.run)
        except (TypeError, ValueError):
            cls._throttle_call_signature = None
    signature: inspect.Signature | None = cls._throttle_call_signature
    return signature


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
