"""A body that raises :class:`~celery_throttle.Backoff` (a 429 or a 503 downstream): its
scope (or key) paused for every worker, and the task at the front of its key's line, its
retries untouched. And a body's ``cost_after``, charged as it returns."""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery.exceptions import Ignore

from ..check.adaptive import lower
from ..check.controller import controller
from ..core.backoff import Backoff
from ..core.cost import too_costly
from ..core.errors import StoreError
from ..core.protocol import Verdict
from ..core.timing import shortest_us
from ..waits.deferral import TurnedAway
from . import settle
from .hook import header_of

__all__ = ["back_off", "catching_backoff"]

logger = logging.getLogger("celery_throttle")


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
    # (An adaptive limit lowered is the answer to a refusal that asks for a moment: only a
    # downstream that asks for more than a window of the rate is paused for it.)
    if adapt is None or not call.rates or exc.seconds * 1_000_000 > shortest_us(call.rates):
        try:
            ctl.pause(call.scope, key, exc.seconds)
        except StoreError as error:
            logger.warning("could not pause scope %r for %s[%s]: %s", call.scope, task.name, request.id, error)
        logger.warning("%s[%s] backs off: scope %r%s paused for %.1fs on every worker", task.name, request.id,
                       call.scope, "" if key is None else f" key {key!r}", exc.seconds)
    turned = TurnedAway(ctl, task, request, args, kwargs, call, header_of(request))
    try:
        reply = ctl.checker.front(call, turned.entry(with_message=True))
    except StoreError as error:
        # Not kept in its line: sent back for the pause all the same.
        logger.warning("could not put %s[%s] back in its line (%s): it is sent back for the pause", task.name,
                       request.id, error)
        turned.send_back(exc.seconds)
        raise Ignore() from None
    ctl.lines.handle(call, reply)
    if reply.verdict is Verdict.REFUSED:
        # (Its cost is above a rate's limit now, lowered while it ran: it never fits.)
        raise too_costly(call.scope, call.rates, call.cost)
    turned.waits(reply, reason="backoff")
    raise Ignore()
