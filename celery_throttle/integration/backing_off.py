"""A body that raises :class:`~celery_throttle.Backoff` (a 429 or a 503 downstream): its
scope (or key) paused for every worker, and the task at the front of its key's line, its
retries untouched. And a body's ``cost_after``, charged as it returns."""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from typing import Any

from celery.exceptions import Ignore

from ..check.adaptive import lower
from ..check.controller import controller
from ..core.backoff import DEFAULT_BACKOFF, FIRST_UNASKED_BACKOFF, MIN_BACKOFF, Backoff
from ..core.cost import too_costly
from ..core.errors import StoreError
from ..core.locks import ForkSafeLock
from ..core.protocol import Verdict
from ..core.timing import shortest_us
from ..waits.deferral import TurnedAway
from . import settle
from .hook import header_of

__all__ = ["back_off", "catching_backoff", "pause_for"]

logger = logging.getLogger("celery_throttle")

#: A refusal without a Retry-After repeats the one before (for the same scope and key, in
#: this process) when it comes after that one's pause ended, within this many seconds of its
#: end, and no call of the key returned in this process since: the API still refuses
#: everything once the pause is over (down, or an outage), so the next pause is twice as
#: long. A call that returned between them makes it a limit's refusal, not an outage: the
#: next pause is short again (doubling then, a throttle declared above the API's limit
#: refused after each pause, grew its pauses to DEFAULT_BACKOFF and ran one second in 30).
#: (Refusals during a pause, of calls that started before it, are the same refusal.)
REPEAT_WITHIN = 10.0
#: The most scopes and keys a process remembers the refusals of (the oldest forgotten first).
STREAKS_KEPT = 10_000

_streaks: OrderedDict[tuple[str, Any], tuple[float, float]] = OrderedDict()
_streaks_lock = ForkSafeLock()


def pause_for(exc: Backoff, *, adaptive: bool, window_us: float, ident: tuple[str, Any]) -> float:
    """How long (seconds) a :class:`Backoff` pauses its scope or key (0: not at all).

    The API's Retry-After when it gave one; under ``adaptive``, only if it is longer than a
    window of the rate (``window_us``): the lowered limit is the answer to a refusal that
    asks for a moment, or for nothing. Without a Retry-After and without ``adaptive``:
    FIRST_UNASKED_BACKOFF, doubling while refusals repeat with no call of the key returning
    in between (REPEAT_WITHIN, :func:`returned`), at most DEFAULT_BACKOFF."""
    if exc.asked is not None:
        return 0.0 if adaptive and exc.asked * 1_000_000 <= window_us else exc.asked
    if adaptive:
        return 0.0
    now = time.monotonic()
    with _streaks_lock:
        last = _streaks.pop(ident, None)
        if last is not None and now < last[1]:
            _streaks[ident] = last  # (during the pause: the same refusal, the pause it got)
            return max(last[1] - now, MIN_BACKOFF)
        seconds = FIRST_UNASKED_BACKOFF
        if last is not None and now <= last[1] + REPEAT_WITHIN:
            seconds = min(2 * last[0], DEFAULT_BACKOFF)
        _streaks[ident] = (seconds, now + seconds)
        while len(_streaks) > STREAKS_KEPT:
            _streaks.popitem(last=False)
    return seconds


def returned(task_id: str | None) -> None:
    """A throttled body returned: its key's refusals in this process no longer repeat (the
    API took a call since the last)."""
    if not _streaks or task_id is None:
        return
    call = settle.call_of(task_id)
    if call is not None:
        with _streaks_lock:
            _streaks.pop((call.scope, call.key), None)
            _streaks.pop((call.scope, None), None)


def catching_backoff(run: Any, task: Any) -> Any:
    """``run`` (a staticmethod, or a method taking the task first) that turns a
    :class:`Backoff` raised by the body into a pause and a re-send."""
    if isinstance(run, staticmethod):
        fun = run.__func__

        @functools.wraps(fun)
        def run_static(*args: Any, **kwargs: Any) -> Any:
            try:
                return _settled(task, fun(*args, **kwargs))
            except Backoff as exc:
                back_off(task, exc, args, kwargs)

        return staticmethod(run_static)

    @functools.wraps(run)
    def run_bound(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return _settled(self, run(self, *args, **kwargs))
        except Backoff as exc:
            back_off(self, exc, args, kwargs)

    return run_bound


def _settled(task: Any, result: Any) -> Any:
    """``result`` of a body, its ``cost_after(result)`` charged first (see :mod:`.settle`)."""
    returned(task.request.id)
    cost_after = getattr(type(task)._throttle_spec, "cost_after", None)
    if cost_after is not None and not (task.request.is_eager or task.request.called_directly):
        settle.charge_after(cost_after, result, task)
    return result


def back_off(task: Any, exc: Backoff, args: Any, kwargs: Any) -> None:
    """Pause the task's scope (and key) for every worker, and put the task at the front of
    its key's line, to run when the pause is over, its retries untouched. Raises Ignore
    (or ``exc`` for a call that is not a task execution: eager, direct)."""
    request = task.request
    if request.is_eager or request.called_directly:
        raise exc
    ctl = controller(task.app)
    call = ctl.checker.bind(task, args, kwargs)
    key = None if exc.whole_scope else call.key
    adapt = type(task)._throttle_spec.adapt
    if adapt is not None and call.rates:
        try:
            lower(ctl.store, call, adapt)
        except StoreError as error:
            logger.warning("could not lower the adaptive limit of scope %r for %s[%s]: %s", call.scope, task.name,
                           request.id, error)
    seconds = pause_for(exc, adaptive=adapt is not None and bool(call.rates),
                        window_us=shortest_us(call.rates) if call.rates else 0, ident=(call.scope, key))
    if seconds:
        try:
            ctl.pause(call.scope, key, seconds)
        except StoreError as error:
            logger.warning("could not pause scope %r for %s[%s]: %s", call.scope, task.name, request.id, error)
        logger.warning("%s[%s] backs off: scope %r%s paused for %.1fs on every worker%s", task.name, request.id,
                       call.scope, "" if key is None else f" key {key!r}", seconds,
                       " (no Retry-After: longer while refusals repeat)" if exc.asked is None else "")
    turned = TurnedAway(ctl.setup, ctl.lines, task, request, args, kwargs, call, header_of(request))
    try:
        reply = ctl.checker.front(call, turned.entry(with_message=True))
    except StoreError as error:
        # Not kept in its line: sent back for the pause all the same.
        logger.warning("could not put %s[%s] back in its line (%s): it is sent back for the pause", task.name,
                       request.id, error)
        turned.send_back(seconds or FIRST_UNASKED_BACKOFF)
        raise Ignore() from None
    ctl.lines.handle(call, reply)
    if reply.verdict is Verdict.REFUSED:
        # (Its cost is above a rate's limit now, lowered while it ran: it never fits.)
        raise too_costly(call.scope, call.rates, call.cost)
    turned.waits_in_pool(reply, reason="backoff")
    raise Ignore()
