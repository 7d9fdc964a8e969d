"""Costs settled after the call: ``celery_throttle.charge(units)`` in a throttled body, or
``cost_after=`` on the decorator.

A call is counted with its estimate (``cost``) when it is admitted; once the body knows
what it really used (the tokens an LLM reply reports), :func:`charge` replaces that
estimate: the difference is added to (a refund: taken from) the span the window counted
the call in (window.lua's ``settle``), so a refund lets the tasks waiting in its key's line
go at once, and an overrun holds them back. The window then holds at most N *reported* units in any
window, estimates standing in until the report. A call admitted from a process's lease
(a busy key far under its limit) keeps a refund counted (where in the lease it counts is
not known) and counts an overrun from the report.

A throttle whose rates count different units (``"500/m"`` and ``"30000 tokens/m"``)
is charged by unit: ``charge(tokens=1234)`` settles the rates counting tokens, and the
others keep what they counted.

The hook notes, in the thread (or greenlet) that runs the body, where the call was
counted; :func:`charge` reads it there.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import current_task

from ..check.controller import controller
from ..core import api_limits
from ..core.errors import StoreError, ThrottleError
from ..core.protocol import Cost, Counted, one_cost, per_rate
from ..core.spec import BoundCall
from ..core.timing import shortest_us

__all__ = ["OBSERVE_FRESH", "charge", "observe"]

logger = logging.getLogger("celery_throttle")

#: The oldest reply :func:`observe` reads, as a share of the call's shortest window: an API
#: counts a call when it arrives and says what it had left then, so a reply that took
#: longer (an LLM's completion of seconds) is compared with a window that has moved on
#: since (calls ended, others started): the difference is no longer what the API counted
#: that the throttle did not. (Bench section observe, calls of 3 s in a 10 s window: read
#: anyway, the key was held back 1.19x the fastest compliant schedule, 1.05 without.)
OBSERVE_FRESH = 0.1


@dataclass
class _Running:
    task_id: str
    call: BoundCall
    counted: Counted
    #: The units the window counts the call with now (of every rate, or per rate).
    units: Cost


class _Bodies(threading.local):
    #: Bodies whose call was counted (a rate's units: what charge() settles).
    running: dict[str, _Running]
    #: Every admitted body's call (a throttle of slots alone counts nothing).
    calls: dict[str, BoundCall]

    def __init__(self) -> None:
        self.running, self.calls = {}, {}


_bodies = _Bodies()


def started(task_id: str, call: BoundCall, counted: Counted | None) -> None:
    """The hook admitted ``task_id`` (in this thread), counted as ``counted``."""
    _bodies.calls[task_id] = call
    if counted is not None:
        _bodies.running[task_id] = _Running(task_id, call, counted, counted.units)


def call_of(task_id: str) -> BoundCall | None:
    """The call of ``task_id``'s body running in this thread, as the hook admitted it."""
    return _bodies.calls.get(task_id)


def ended(task_id: str) -> None:
    _bodies.running.pop(task_id, None)
    _bodies.calls.pop(task_id, None)


def charge(units: int | None = None, **by_unit: int) -> None:
    """Report what this throttled body really used: ``units`` replace the estimate its
    ``cost`` was counted with (call it again to correct it; the last report stands). For
    rates of named units, by name: ``charge(tokens=1234)`` settles the rates that count
    tokens (a rate of a unit not named keeps its count); ``charge(n)`` (or ``units=n``) is
    for a throttle whose rates all count one unit.

    Does nothing in a call that is not throttled: a direct call, ``.apply()``, or
    ``task_always_eager`` (a unit test of the body). Raises
    :class:`~celery_throttle.core.errors.ThrottleError` outside the body of a task, for a unit
    count that is not an integer >= 0, or a unit its rates do not count. A store that
    cannot be reached is logged, not raised: the body's own outcome stands.
    """
    if (units is None) == (not by_unit):
        raise ThrottleError("charge() takes the units used: charge(1234), or by unit, charge(tokens=1234)")
    for name, value in by_unit.items() if units is None else (("units", units),):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ThrottleError(f"charge() takes the units used, each an integer >= 0, got {name}={value!r}")
    request = getattr(current_task, "request", None)
    task_id = getattr(request, "id", None)
    running = _bodies.running.get(task_id) if task_id else None
    if running is None and request is not None and (request.is_eager or request.called_directly):
        return  # (never throttled: nothing was counted to settle)
    if running is None:
        raise ThrottleError("charge() is called in the body of a task with a @throttle (or a rule), "
                            "while it runs; this is not one")
    reported = _reported(running.call, running.units, units, by_unit)
    n = len(running.call.rates)
    delta = one_cost([r - c for r, c in zip(per_rate(reported, n), per_rate(running.units, n))])
    if delta == 0:
        return
    ctl = controller(current_task.app)
    try:
        reply = ctl.checker.settle(running.call, running.counted, delta)
        ctl.lines.handle(running.call, reply)  # (a refund lets the line's head go at once)
    except StoreError as exc:
        ctl.metrics.store_error("settle")
        logger.warning("could not settle the cost of %s[%s] (%s units, estimated %s): %s", current_task.name,
                       task_id, units if units is not None else by_unit, running.units, exc)
        return
    running.units = reported


def observe(response: Any) -> dict[str, int]:
    """Bring this throttled body's key to the API's own count: where a reply's headers
    (``response``: a ``requests``/``httpx`` response, or its headers) say the API has less
    room left in its window than the throttle's window of that unit has, this call is
    charged the difference on top of what it counts, for every worker's next check. Returns
    the units added, by unit (``""``: requests). Never lowers a count: an API that sees more
    room than the throttle (its window began later) leaves the throttle's count as it is.

    Read: ``x-ratelimit-remaining-requests``/``-tokens``, ``anthropic-ratelimit-*-remaining``,
    ``x-ratelimit-remaining``, ``x-rate-limit-remaining``, ``ratelimit-remaining`` and the
    IETF ``RateLimit`` field (:mod:`celery_throttle.core.api_limits`). Does nothing outside a
    throttled call (a direct call, eager). Costs one read of the key's windows; a store that
    cannot be reached is logged, not raised. (Two bodies that observe the same reply's count
    at once each add the difference: the key is held back more than the API asks, never
    less.)

    Where the headers also say when the API's window resets (``x-ratelimit-reset-*``,
    ``anthropic-ratelimit-*-reset``, ``x-ratelimit-reset``, the IETF fields' reset:
    :func:`celery_throttle.core.api_limits.resets`) and that is sooner than the rate's
    window, the difference is counted a window before that reset, so that it leaves the
    throttle's window when the API's resets (counted now, it would hold the key back up to
    a whole window past it: GitHub's hour ends at a fixed time); and a unit with nothing
    left pauses the key until the reset, on every worker (a unit the throttle has no rate
    of included). The difference is not the call's own cost: a ``charge()`` after it
    settles the call's estimate alone.

    A reply that says how long it took (``elapsed``, as ``requests`` and ``httpx`` give it)
    and took longer than OBSERVE_FRESH of the call's shortest window is not read: the API's
    count is of when the call arrived, the throttle's window has moved on since. (A 429
    comes at once: it is read.)"""
    headers = getattr(response, "headers", response)
    said = api_limits.remaining(headers)
    request = getattr(current_task, "request", None)
    task_id = getattr(request, "id", None)
    running = _bodies.running.get(task_id) if task_id else None
    if not said or running is None or not running.call.rates:
        return {}
    took = _elapsed(response)
    if took is not None and took * 1_000_000 > OBSERVE_FRESH * shortest_us(running.call.rates):
        return {}
    ctl = controller(current_task.app)
    call, n = running.call, len(running.call.rates)
    resets = api_limits.resets(headers)
    _pause_until_reset(ctl, call, {unit: at for unit, (left, at) in resets.items() if not left}, task_id)
    try:
        status = ctl.status(call.scope, call.key)
    except StoreError as exc:
        logger.warning("could not read the windows of %s[%s] to bring them to the API's count: %s",
                       current_task.name, task_id, exc)
        return {}
    delta, now = [0] * n, time.time()
    #: where each rate's difference is counted (µs; 0: the call's own span)
    spans = [0] * n
    for i, rate in enumerate(call.rates):
        theirs = said.get(rate.unit)
        # (the status's rate of this unit and window: the call's window has the margin added)
        same = [r for r in status.rates if r.rate.unit == rate.unit]
        if theirs is None or not same:
            continue
        ours = min(same, key=lambda r: abs(r.rate.period - rate.period)).remaining
        if ours > theirs:
            delta[i] = ours - theirs
        if rate.unit in resets and resets[rate.unit][1] < rate.period:
            # (The API's window resets sooner than a count now would leave this one's: counted
            # a window before the API's reset, the difference leaves this window with it.)
            spans[i] = int((now + resets[rate.unit][1] - rate.period) * 1_000_000)
    if not any(delta):
        return {}
    counted = running.counted
    try:
        for span in sorted({spans[i] for i in range(n) if delta[i]}):
            at = counted if not span else Counted(span, span, counted.units, counted.epoch)
            reply = ctl.checker.settle(call, at, one_cost([d if s == span else 0 for d, s in zip(delta, spans)]))
            ctl.lines.handle(call, reply)
    except StoreError as exc:
        ctl.metrics.store_error("settle")
        logger.warning("could not bring the windows of %s[%s] to the API's count: %s", current_task.name, task_id,
                       exc)
        return {}
    # (Not this call's own cost: a charge() after it settles the call's estimate alone.)
    added: dict[str, int] = {}
    for rate, d in zip(call.rates, delta):
        if d:
            added[rate.unit] = max(added.get(rate.unit, 0), d)
    return added


def _pause_until_reset(ctl: Any, call: BoundCall, waits: dict[str, float], task_id: str | None) -> None:
    """The API has nothing left until its window resets (``waits``, by unit): the key
    starts nothing until then, on every worker (its window may have room sooner: the API's
    resets at its own time, a fixed hour's end for GitHub)."""
    seconds = max(waits.values(), default=0.0)
    if seconds <= 0:
        return
    try:
        ctl.pause(call.scope, call.key, seconds)
    except StoreError as exc:
        logger.warning("could not pause %s[%s] until the API's window resets (%.1fs): %s", current_task.name,
                       task_id, seconds, exc)


def _elapsed(response: Any) -> float | None:
    """Seconds ``response`` took, from its ``elapsed`` (a timedelta or seconds), or None."""
    elapsed = getattr(response, "elapsed", None)
    seconds = elapsed.total_seconds() if isinstance(elapsed, timedelta) else elapsed
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds >= 0:
        return float(seconds)
    return None


def _reported(call: BoundCall, counted: Cost, units: int | None, by_unit: dict[str, int]) -> Cost:
    """What a call of ``call``'s rates now counts in each, after a report of ``units`` (of
    every rate) or ``by_unit``; ``counted``: what each counted before."""
    named = {rate.unit for rate in call.rates}
    if units is not None:
        if len(named) > 1:
            example = max(named)
            raise ThrottleError(f"this throttle's rates count several units ({', '.join(u or 'calls' for u in sorted(named))}): "
                                f"charge them by name, e.g. charge({example}=1234)")
        return units
    unknown = sorted(set(by_unit) - named)
    if unknown:
        counts = ", ".join(sorted(u for u in named if u)) or "no named unit"
        raise ThrottleError(f"charge() names unit(s) {unknown} that this throttle's rates do not count "
                            f"(they count: {counts}; a rate counts a unit when it names it, \"30000 tokens/m\")")
    before = per_rate(counted, len(call.rates))
    return one_cost([by_unit.get(rate.unit, old) for rate, old in zip(call.rates, before)])


def charge_after(spec_cost_after: Any, result: Any, task: Any) -> None:
    """``cost_after(result)`` of a body that returned, charged; a cost_after that fails
    or answers something else is logged (the task's result stands)."""
    try:
        units = spec_cost_after(result)
        if isinstance(units, dict):
            charge(**units)
        else:
            charge(units)
    except Exception as exc:  # noqa: BLE001 - the result stands; the estimate stays counted
        logger.warning("cost_after of %s[%s] failed (%r): its estimate stays counted", task.name,
                       getattr(task.request, "id", None), exc)
