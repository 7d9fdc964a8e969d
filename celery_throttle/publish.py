"""Admission at publish: the producer defers a throttled task that does not fit.

Without it, a flood of one key's tasks against a spent quota sits in the queue, and the
workers must take every one of those messages and turn it away before they reach what is
behind it: another tenant's tasks wait for the whole flood, however cheap each turning
away is. So when a hooked task is sent (not eagerly, with no ETA or countdown of its own,
not already carrying a reservation), the producer reserves its start with one script
call: now (or as soon as a task of its key usually takes to reach a worker) when it fits,
later when it does not. The reservation goes with the message, which is sent at once, or
with a countdown to that start, or parked in Redis when the wait is long; the worker
claims the start when the task arrives. The queue then only ever holds tasks that may run
soon. When the call cannot be bound, or Redis cannot be reached, the task is sent as it
is and the worker decides, as without this step; after a store error, publishing skips
the check for a few seconds rather than wait on Redis for every task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from celery.app.task import Context
from kombu.exceptions import EncodeError

from . import signals
from .breaker import Breaker
from .deferral import HEADER, plan_return
from .errors import StoreError, ThrottleError
from .parking import park
from .store import Code
from .timing import STORE_ERROR_PAUSE

if TYPE_CHECKING:
    from .limiter import Throttle

__all__ = ["Deferral", "admit", "park_at_publish"]

logger = logging.getLogger("celery_throttle")


#: Options of ``apply_async`` that belong to this one send, not to the message: they are
#: not parked with it.
_SEND_ONLY = frozenset({"producer", "connection", "publisher", "result_cls", "add_to_parent", "router",
                        "task_type", "retry", "retry_policy", "declare", "exchange_type"})


class Deferral(NamedTuple):
    """What publishing does with a task that did not fit."""

    #: The task's ``celery_throttle`` header: the start it reserved.
    state: dict[str, Any]
    #: Seconds until it should be sent (its countdown, or how long it stays parked).
    delay: float
    #: Whether the wait is long enough to park it in Redis rather than send it now.
    park: bool
    #: The script's "now" (Redis clock, µs): parked tasks are due at now + delay.
    now_us: int


#: Checks at publish, paused after a store error (one per producer process).
_breaker = Breaker(STORE_ERROR_PAUSE)


def admit(ctl: Throttle, task: Any, args: Any, kwargs: Any, options: Mapping[str, Any]) -> Deferral | None:
    """Screen one send of ``task``; None: send it as it is."""
    headers = options.get("headers") or {}
    if (options.get("countdown") is not None or options.get("eta") is not None
            or not isinstance(headers, Mapping) or HEADER in headers
            or task.app.conf.task_always_eager or _breaker.open):
        return None
    settings = ctl.settings
    if not (settings.enabled and settings.check_at_publish):
        return None
    try:
        spec = type(task)._throttle_spec
        call = ctl.bind(task, args, kwargs, quick=True)
        reply = ctl.reserve_at_publish(call, max_wait=ctl.max_wait(spec))
    except StoreError as exc:
        ctl.metrics.store_error("producer")
        _breaker.trip()
        logger.warning("throttle store unreachable at publish: tasks are sent unchecked for %.0fs "
                       "(the workers check them): %s", STORE_ERROR_PAUSE, exc)
        return None
    except ThrottleError:
        return None  # bad arguments: the worker's check reports it, visibly
    if reply.code != Code.DENIED or not reply.start_us:
        return None  # no start reserved (none found, or too far): the worker decides
    state: dict[str, Any] = {}
    delay = plan_return(ctl, call, state, None, reply)
    parked = delay >= settings.park_after
    if delay > 0:  # turned away: not a task that goes now with its start
        state["n"] = 1
        ctl.metrics.denied(call.scope, call.key, delay, parked)
        signals.task_throttled.send(sender=task, request=Context(args=args, kwargs=kwargs, headers=headers),
                                    delay=delay, scope=call.scope, key=call.key, parked=parked)
    return Deferral(state, delay, parked, reply.now_us)


def park_at_publish(ctl: Throttle, task: Any, deferral: Deferral, args: Any, kwargs: Any,
                    options: Mapping[str, Any]) -> bool:
    """Park a task whose wait is long instead of sending it; False if that failed (it is
    then sent with its countdown, like any short wait)."""
    kept = {k: v for k, v in options.items() if k not in _SEND_ONLY and v is not None}
    parent = task.app.current_worker_task
    if parent is not None:  # what send_task would have set for a task sent from a task
        kept.setdefault("parent_id", parent.request.id)
        kept.setdefault("root_id", parent.request.root_id or parent.request.id)
    try:
        park(ctl, task.signature(args, kwargs, **kept), due_us=deferral.now_us + int(deferral.delay * 1e6))
    except (StoreError, EncodeError, TypeError, ValueError) as exc:  # Redis, or an unserializable option
        logger.warning("could not park %s[%s] at publish, sending it with its countdown: %r",
                       task.name, kept.get("task_id"), exc)
        return False
    return True
