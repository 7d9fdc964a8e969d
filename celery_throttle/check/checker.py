"""The checks of one call, for the paths that check: the pool's hook (:meth:`Checker.acquire`,
:meth:`Checker.claim`), the consumer's screen (:meth:`Checker.screen`), publish
(:meth:`Checker.admit`), and what a line needs done (release, settle, a slot's end).

A :class:`Checker` binds a task's throttle to one call's arguments (:mod:`.binding`: under
the live limits and pauses this process has read), tells the store's window operations what
they need to know of it (a :class:`.protocol.WindowCall`, made once per call shape), and
keeps this process's leases. :class:`.limiter.Throttle` owns one, and the settings and
store connections it works with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..core import timing
from ..core.keys import shadow_key
from ..core.protocol import NO_ENTRY, Code, Cost, Counted, Entry, WindowCall, WindowReply
from ..core.rates import Rate
from ..core.spec import BoundCall
from ..store.client import RedisStore
from .binding import Binder, Stores
from .unit_leases import Leases, sent_at

__all__ = ["Checker"]


class Checker(Binder):
    """The checks of one app's throttled calls, in this process."""

    def __init__(self, owner: Stores) -> None:
        super().__init__(owner)
        self._leases = Leases()
        #: What the script is told, by call shape (see _window_call).
        self._requests: dict[tuple[Any, ...], WindowCall] = {}
        #: When the controls those were made under were read (each tells the script so).
        self._requests_read_us = 0

    def forget(self) -> None:
        """Forget what was read of the settings (they changed)."""
        super().forget()
        self._requests = {}

    @staticmethod
    def slack_us(rates: Sequence[Rate]) -> int:
        """See :func:`.timing.slack_us`."""
        return timing.slack_us(rates)

    @staticmethod
    def lease_span_us(rates: Sequence[Rate]) -> int:
        """See :func:`.timing.lease_span_us`."""
        return timing.lease_span_us(rates)

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

    def release(self, call: BoundCall, batch: int, *, drain: bool = False, sent: Sequence[str] = ()) -> WindowReply:
        """Release the heads of ``call``'s line that fit (``drain``: whatever the room),
        once the tasks released with ``sent`` (since its last release) are acked."""
        key, request = self._window_call(call, self.store)
        return (self.store.drain if drain else self.store.release)(key, request, batch, sent)

    def ack(self, call: BoundCall, tickets: Sequence[str]) -> WindowReply:
        key, request = self._window_call(call, self.store)
        return self.store.ack(key, request, tickets)

    def give_back(self, call: BoundCall, ticket: str, handed_back: bool = False,
                  shadowed: bool = False) -> WindowReply:
        """The task released with ``ticket`` will not start (expired, revoked; or, handed
        back, not here: it goes again from its place; or, shadowed, it starts outside the
        rules: ``DUPLICATE`` if it already did)."""
        key, request = self._window_call(call, self.store)
        return self.store.give_back(key, request, ticket, timing.WORKER_BATCH, handed_back, shadowed)

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

    def take_back(self, call: BoundCall, lined: Sequence[str], out: Sequence[str]) -> WindowReply:
        key, request = self._window_call(call, self.store)
        return self.store.take_back(key, request, lined, out)

    def peek(self, call: BoundCall) -> WindowReply:
        key, request = self._window_call(call, self.store)
        return self.store.peek(key, request)

    def shadow(self, call: BoundCall, holder: str, max_wait_us: int) -> tuple[BoundCall, WindowReply]:
        """A call of a throttle in shadow mode: where enforcing would have started it, on
        the key's shadow state (:func:`.keys.shadow_key`), which it returns as a call (its
        slot, ``held``, is renewed and ended there). Against the rates and K in force, a
        shared K counted per key; never an adaptive level."""
        shadowed = replace(call, state_key=shadow_key(call.state_key), adapt=None, share=None)
        key, request = self._window_call(shadowed, self.store)
        return shadowed, self.store.shadow(key, request, holder, max_wait_us)

    def _window_call(self, call: BoundCall, store: RedisStore) -> tuple[str, WindowCall]:
        """The state key of ``call`` and what the script is told about it."""
        not_before = self.controls.paused_until(store, call.scope, call.key)
        # (A store far away: tasks are released a round trip earlier, the reply and the
        # claim each travel half of one.)
        far_us = timing.round_trip_allowance_us(store.rtt_us)
        # The same few shapes come again and again: their WindowCall (and with it the
        # ARGV head it builds) is made once, not on every check.
        read_us = self.controls.read_at_us
        if read_us != self._requests_read_us:  # (the controls were read again: each shape tells when)
            self._requests.clear()
            self._requests_read_us = read_us
        shape = (call.algorithm, call.rates, call.cost, call.fields, call.concurrency, not_before, far_us, call.adapt,
                 call.share is not None)
        request = self._requests.get(shape)
        if request is None:
            request = WindowCall(
                call.algorithm, call.rates, call.cost, call.fields, slack_us=self.slack_us(call.rates),
                not_before_us=not_before, concurrency=call.concurrency,
                slot_lease_us=int(self.settings.concurrency_lease * 1_000_000),
                lead_us=timing.release_lead_us(call.rates, far_us),
                adapt=None if call.adapt is None else (call.adapt.floor, call.adapt.decrease, call.adapt.growth),
                shared=call.share is not None, read_us=read_us,
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


#: Call shapes whose WindowCall a Checker keeps (rates, cost, max wait, pause end).
_REQUEST_SHAPES = 1024

