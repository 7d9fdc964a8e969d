"""Admission at publish: the producer defers a throttled task that does not fit.

Without it, a flood of one key's tasks against a spent quota sits in the queue, and the
workers must take every one of those messages and turn it away before they reach what is
behind it: another tenant's tasks wait for the whole flood, however cheap each turning
away is.

Every message the app publishes goes through ``app.send_task`` (``.delay()``,
``.apply_async()``, canvas, ``send_task`` by name), which :func:`wrap_send_task` wraps
when ``install(app)`` is called: nothing depends on the app being finalized, as a
script, a web view or beat never finalizes it. A task is admitted there when the app
knows a throttle for its name (a ``@throttle`` on its task, or a rule), it is not sent
eagerly, with an ETA or countdown of its own, or already carrying a reservation.

Most sends cost no Redis call at all. The check answers, for a key with room (every rate
at most half full), how many units the key may still take before a rate is half full;
this process then sends that many (at most) unchecked for a while (:class:`Hints`),
since the workers' own check counts every start anyway. A key near or over its limit is
checked send by send, and a task that does not fit reserves its start with that one
call: it leaves with a countdown to it, or is parked in Redis when the wait is long, and
the worker claims the start when the task arrives. The queue then only holds tasks that
may run soon. When the call cannot be bound, or Redis cannot be reached, the task is sent
as it is and the worker decides; after a store error, publishing skips the check for a
few seconds rather than wait on Redis for every task.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from celery.app.task import Context
from celery.utils import uuid
from kombu.exceptions import EncodeError

from . import signals
from .breaker import Breaker
from .deferral import plan_return
from .errors import StoreError, ThrottleError
from .hints import Hints
from .internals import registered_task
from .keys import state_tag
from .messages import encode_message
from .parking import park
from .protocol import HEADER, Code, Cost, SlotCode, header_value
from .spec import BoundCall, ThrottleSpec, declared_spec
from .timing import PUBLISH_HINT_MAX, STORE_ERROR_PAUSE, shortest_us

if TYPE_CHECKING:
    from .limiter import Throttle

__all__ = ["Deferral", "Known", "admit", "queue_for_slot", "throttle_of", "wrap_send_task"]

logger = logging.getLogger("celery_throttle")


#: Options of ``send_task`` that belong to this one send, not to the message: they are
#: not parked with it.
_SEND_ONLY = frozenset({"producer", "connection", "publisher", "result_cls", "add_to_parent", "router",
                        "task_type", "retry", "retry_policy", "declare", "exchange_type", "countdown", "eta"})


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
    #: The call it was checked as.
    call: BoundCall
    #: Its task, if this process has it (else its name): the signals' sender.
    task: Any
    #: Whether a pause holds it (then it is parked, for a resume to find).
    held: bool = False


#: Checks at publish, paused after a store error (one per producer process).
_breaker = Breaker(STORE_ERROR_PAUSE)


def wrap_send_task(ctl: Throttle) -> None:
    """Admit every task ``ctl.app`` sends (once per app)."""
    app = ctl.app
    send = app.send_task
    if getattr(send, "_throttle_admits", False):
        return

    def send_task(name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        bound = _bound(ctl, name, args, kwargs, options)
        if bound is None:
            return send(name, args, kwargs, **options)
        known, call = bound
        if call.concurrency:
            queued = queue_for_slot(ctl, name, args, kwargs, options, known, call)
            if queued is not None:
                return queued
        deferral = admit(ctl, name, known, call) if call.rates and not _breaker.open else None
        if deferral is None:
            return send(name, args, kwargs, **options)
        options.pop("countdown", None)
        options.pop("eta", None)
        task_id = options.pop("task_id", None) or uuid()
        headers = options["headers"] = {**(options.get("headers") or {}), HEADER: header_value(deferral.state)}
        if deferral.delay > 0:  # turned away: not a task that goes now with its start
            call = deferral.call
            ctl.metrics.denied(call.scope, call.key, deferral.delay, deferral.park)
            request = Context(id=task_id, task=name, args=args, kwargs=kwargs, headers=headers)
            signals.task_throttled.send(sender=deferral.task, request=request, delay=deferral.delay,
                                        scope=call.scope, key=call.key, parked=deferral.park, reason="rate")
        if deferral.park and _park(ctl, name, deferral, args, kwargs, dict(options, task_id=task_id)):
            return _result(app, task_id, options)
        return send(name, args, kwargs, task_id=task_id, countdown=deferral.delay or None, **options)

    send_task._throttle_admits = True  # type: ignore[attr-defined]
    send_task.__wrapped__ = send  # type: ignore[attr-defined]
    app.send_task = send_task


class Known(NamedTuple):
    """The throttle this app knows for a task name."""

    spec: ThrottleSpec
    #: What its arguments bind to (None: this process does not have the task).
    signature: inspect.Signature | None
    #: The task, or None.
    task: Any


def throttle_of(ctl: Throttle, name: str, task: Any) -> Known | None:
    """The throttle this app knows for task ``name`` (``task``: its task, if the caller
    has it); None if it has none."""
    if task is None:
        task = registered_task(ctl.app, name)
    spec = declared_spec(task) if task is not None else None
    if spec is None:
        spec = ctl.checker.rule_for(name) if not name.startswith("celery.") else None
    if spec is None:
        return None
    return Known(spec, _signature(task) if task is not None else None, task)


def _signature(task: Any) -> inspect.Signature | None:
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


def _bound(ctl: Throttle, name: str, args: Any, kwargs: Any,
           options: Mapping[str, Any]) -> tuple[Known, BoundCall] | None:
    """The throttle of one send of task ``name``, bound to its arguments; None: send it as
    it is (no throttle; not checked at publish; an ETA, a countdown or a reservation of its
    own; checks paused after a store error; or arguments that do not bind: the worker's
    check reports them, visibly)."""
    headers = options.get("headers") or {}
    if (options.get("countdown") is not None or options.get("eta") is not None
            or not isinstance(headers, Mapping) or HEADER in headers or _breaker.open):
        return None
    settings = ctl.settings
    if not (settings.enabled and settings.check_at_publish):
        return None
    try:
        known = throttle_of(ctl, name, options.get("task_type"))
        if known is None:
            return None
        return known, ctl.checker.bind_spec(name, known.spec, known.signature, args, kwargs, quick=True)
    except ThrottleError:
        return None


def _unreachable(ctl: Throttle, exc: StoreError) -> None:
    """The store failed a check at publish: tasks go unchecked for a while."""
    ctl.metrics.store_error("producer")
    _breaker.trip()
    logger.warning("throttle store unreachable at publish: tasks are sent unchecked for %.0fs "
                   "(the workers check them): %s", STORE_ERROR_PAUSE, exc)


def admit(ctl: Throttle, name: str, known: Known, call: BoundCall) -> Deferral | None:
    """Check the rates of one send of task ``name`` (``call``, of a throttle with rates);
    None: send it as it is."""
    settings, spec = ctl.settings, known.spec
    try:
        ident = call.state_key
        hint = ctl.hints.take(ident, call.cost)
        if hint == Hints.SEND:
            return None
        max_wait = ctl.checker.max_wait(spec)
        if hint == Hints.RESERVE:
            reply = ctl.checker.reserve_at_publish(call, max_wait=max_wait)
        else:
            reply = ctl.checker.admit_at_publish(call, max_wait=max_wait)
    except StoreError as exc:
        _unreachable(ctl, exc)
        return None
    except ThrottleError:
        return None  # bad arguments: the worker's check reports it, visibly
    if reply.code == Code.RUN:  # room: this one and `leased - cost` more go unchecked
        room: Cost = reply.leased - call.cost if isinstance(call.cost, int) else tuple(
            left - units for left, units in zip(reply.rooms, call.cost))
        ctl.hints.open(ident, room, min(shortest_us(call.rates) / 1e6, PUBLISH_HINT_MAX))
        return None
    held = ctl.checker.holds(call, reply.now_us)
    if not (reply.code == Code.RESERVED or (reply.code == Code.DENIED and held)):
        return None  # no start reserved (none found, or too far): the worker decides
    # (A long pause reserves no start: the task is parked until the pause's horizon, or
    # until a resume sends it.)
    state: dict[str, Any] = {}
    delay = plan_return(ctl, call, state, None, reply, held)
    if delay > 0:
        state["n"] = 1  # deferrals so far
    return Deferral(state, delay, delay >= settings.park_after or held, reply.now_us, call,
                    known.task if known.task is not None else name, held)


def _result(app: Any, task_id: str, options: Mapping[str, Any]) -> Any:
    """The result of a task kept instead of sent, as ``send_task`` would return it."""
    result = (options.get("result_cls") or app.AsyncResult)(task_id)
    parent = app.current_worker_task
    if parent is not None and options.get("add_to_parent", True):
        parent.add_trail(result)  # (as send_task does)
    return result


def _kept_options(app: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a send that its message keeps (parked, or queued for a slot)."""
    kept = {k: v for k, v in options.items() if k not in _SEND_ONLY and v is not None}
    parent = app.current_worker_task
    if parent is not None:  # what send_task would have set for a task sent from a task
        kept.setdefault("parent_id", parent.request.id)
        kept.setdefault("root_id", parent.request.root_id or parent.request.id)
    return kept


def queue_for_slot(ctl: Throttle, name: str, args: Any, kwargs: Any, options: Mapping[str, Any],
                   known: Known, call: BoundCall) -> Any:
    """A send whose throttle has a concurrency limit (``call``), when its key has every slot
    taken (or tasks waiting), is not sent: the task is kept with the key's queue, as a
    worker would keep it, and sent when a slot is handed to it. Returns its result then;
    None: send it (and check its rates)."""
    app, slots = ctl.app, ctl.slots
    headers = options.get("headers") or {}
    if slots.seen_free(call):
        return None
    try:
        task_id = options.get("task_id") or uuid()
        state = {"w": int(time.time() * 1_000_000), "n": 1}

        def message() -> bytes:
            kept = _kept_options(app, options)
            kept.update(task_id=task_id, headers={**headers, HEADER: header_value(state)})
            return encode_message(app, app.signature(name, args, kwargs, **kept))

        reply = slots.enqueue(call, task_id, message() if slots.looks_full(call) else b"")
        if reply.code == SlotCode.FULL:
            reply = slots.enqueue(call, task_id, message())
    except StoreError as exc:
        _unreachable(ctl, exc)
        return None
    except (EncodeError, TypeError, ValueError):
        return None  # an unserializable argument or option: sent, and the worker's check reports it
    if reply.code != SlotCode.QUEUED:
        return None
    ctl.metrics.denied(call.scope, call.key, 0.0, True)
    request = Context(id=task_id, task=name, args=args, kwargs=kwargs, headers={HEADER: header_value(state)})
    signals.task_throttled.send(sender=known.task if known.task is not None else name, request=request, delay=None,
                                scope=call.scope, key=call.key, parked=True, reason="concurrency")
    return _result(app, task_id, options)


def _park(ctl: Throttle, name: str, deferral: Deferral, args: Any, kwargs: Any,
          options: Mapping[str, Any]) -> bool:
    """Park a task whose wait is long instead of sending it; False if that failed (it is
    then sent with its countdown, like any short wait)."""
    app = ctl.app
    kept = _kept_options(app, options)
    try:
        park(ctl, app.signature(name, args, kwargs, **kept), due_us=deferral.now_us + int(deferral.delay * 1e6),
             tag=state_tag(deferral.call.scope, deferral.call.key) if deferral.held else None, now_us=deferral.now_us)
    except (StoreError, EncodeError, TypeError, ValueError) as exc:  # Redis, or an unserializable option
        logger.warning("could not park %s[%s] at publish, sending it with its countdown: %r",
                       name, kept.get("task_id"), exc)
        return False
    return True
