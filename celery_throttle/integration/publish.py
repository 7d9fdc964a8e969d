"""Admission at publish: a throttled task that cannot start soon waits in its key's line
instead of the broker's queue.

Without it, a flood of one key's tasks against a spent quota sits in the queue, and the
workers must take every one of those messages and turn it away before they reach what is
behind it: another tenant's tasks wait for the whole flood, however cheap each turning
away is.

Every message the app publishes goes through ``app.send_task`` (``.delay()``,
``.apply_async()``, canvas, ``send_task`` by name), which :func:`wrap_send_task` wraps
when ``install(app)`` is called: nothing depends on the app being finalized, as a
script, a web view or beat never finalizes it. A task is admitted there when the app
knows a throttle for its name (a ``@throttle`` on its task, or a rule), it is not sent
eagerly, with an ETA or countdown of its own, or already carrying our header (a task
released from its line is on its way to start).

Most sends cost no Redis call at all. The check answers, for a key with room and nobody
waiting (every rate at most half full), how many units the key may still take before a
rate is half full; this process then sends that many (at most) unchecked for a while
(:class:`.hints.Hints`), since the workers' own check counts every start anyway. Past
that, each send is checked with one call: a task that fits now leaves released, with its
ticket; one that does not joins its key's line (its message kept in the store, the
broker never sees it) and is sent when its key has room. When the call cannot be bound,
or Redis cannot be reached, the task is sent as it is and the worker decides; after a
store error, publishing skips the check for a few seconds rather than wait on Redis for
every task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from celery.app.task import Context
from celery.utils import uuid
from kombu.exceptions import EncodeError

from .. import signals
from ..celery_parts.messages import encode_message, message_urgency
from ..check.binding import Known
from ..check.breaker import Breaker
from ..check.hints import Hints
from ..core.errors import StoreError, ThrottleError
from ..core.header import HEADER, Header
from ..core.protocol import Cost, Entry, Verdict
from ..core.spec import BoundCall
from ..core.timing import PUBLISH_HINT_MAX, STORE_ERROR_PAUSE, WORKER_BATCH, shortest_us
from ..waits.deferral import expires_us, new_entry_id

if TYPE_CHECKING:
    from ..check.limiter import Throttle

__all__ = ["FREE_HINT_S", "admit", "throttle_of", "wrap_send_task"]

logger = logging.getLogger("celery_throttle")

#: Options of ``send_task`` that belong to this one send, not to the message: they are
#: not kept with it.
_SEND_ONLY = frozenset({"producer", "connection", "publisher", "result_cls", "add_to_parent", "router",
                        "task_type", "retry", "retry_policy", "declare", "exchange_type", "countdown", "eta"})
#: For this long (seconds), a producer sends the tasks of a key of slots alone (no rates)
#: unchecked while it found a slot free and nobody waiting: under its limit a key costs a
#: producer at most 1/FREE_HINT_S calls a second (the workers' own check counts every
#: start anyway), and a flood is caught within this long.
FREE_HINT_S = 0.1

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
        if bound is not None:
            kept = admit(ctl, send, name, args, kwargs, options, *bound)
            if kept is not None:
                return kept
        return send(name, args, kwargs, **options)

    send_task._throttle_admits = True  # type: ignore[attr-defined]
    send_task.__wrapped__ = send  # type: ignore[attr-defined]
    app.send_task = send_task


def throttle_of(ctl: Throttle, name: str, task: Any) -> Known | None:
    """The throttle this app knows for task ``name`` (``task``: its task, if the caller
    has it); None if it has none."""
    return ctl.checker.known(ctl.app, name, task)


def _bound(ctl: Throttle, name: str, args: Any, kwargs: Any,
           options: Mapping[str, Any]) -> tuple[Known, BoundCall] | None:
    """The throttle of one send of task ``name``, bound to its arguments; None: send it as
    it is (no throttle; not checked at publish; in shadow mode; an ETA, a countdown or our header of its
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
        call = ctl.checker.bind_spec(name, known.spec, known.signature, args, kwargs, quick=True)
        return None if call.shadow else (known, call)  # (shadow mode holds nothing: the worker reports it)
    except ThrottleError:
        return None


def _urgency(app: Any, call: BoundCall, options: Mapping[str, Any]) -> int:
    """Where a send joins its line: by its throttle's ``priority=``, else by the priority
    it is sent with (its own, else its task's, else ``task_default_priority``)."""
    if call.priority is not None:
        return call.priority
    priority = options.get("priority")
    if priority is None:
        priority = getattr(options.get("task_type"), "priority", None)
    if priority is None:
        priority = app.conf.task_default_priority
    return message_urgency(app, priority)


def _unreachable(ctl: Throttle, exc: StoreError) -> None:
    """The store failed a check at publish: tasks go unchecked for a while."""
    ctl.metrics.store_error("producer")
    _breaker.trip()
    logger.warning("throttle store unreachable at publish: tasks are sent unchecked for %.0fs "
                   "(the workers check them): %s", STORE_ERROR_PAUSE, exc)


def admit(ctl: Throttle, send: Any, name: str, args: Any, kwargs: Any, options: dict[str, Any], known: Known,
          call: BoundCall) -> Any:
    """Check one send of task ``name`` (``call``): None, send it as it is; else what
    ``send_task`` returns for it (sent by ``send`` with its ticket, or kept in its line)."""
    app, ident = ctl.app, call.state_key
    hint = ctl.hints.take(ident, call.cost)
    if hint == Hints.SEND:
        return None
    task_id = options.get("task_id") or uuid()
    max_wait_us = ctl.checker.max_wait_us(known.spec)
    # (Relative to now, as the task leaves: it holds across its wait in the line.)
    expires = _absolute(options.get("expires"))
    entry_id = new_entry_id(task_id)
    ctl.lines.journal.prime()  # (the store's epoch, read before this process's first call)
    urgency = _urgency(app, call, options)

    def message() -> bytes:
        kept = _kept_options(app, options)
        kept.update(task_id=task_id, headers={**(options.get("headers") or {}), HEADER: Header(deferrals=1).value()})
        if expires is not None:
            kept["expires"] = expires.isoformat()
        return encode_message(app, app.signature(name, args, kwargs, **kept))

    def send_naming_entry() -> Any:
        headers = {**(options.get("headers") or {}), HEADER: Header(ident, pending=entry_id).value()}
        return send(name, args, kwargs, **{**options, "task_id": task_id, "headers": headers})

    try:
        for with_message in ctl.lines.tries(call, message_first=hint == Hints.RESERVE):
            kept = message() if with_message else b""
            reply = ctl.checker.admit(call, Entry(entry_id, kept, task_id, expires_us(expires), max_wait_us,
                                                  WORKER_BATCH, urgency=urgency))
            if ctl.lines.checked(call, reply):
                break
    except StoreError as exc:
        _unreachable(ctl, exc)
        # Sent unchecked: it names the entry a call whose reply was lost may have left it
        # in its line, so that its worker does not let it in twice.
        return send_naming_entry()
    except (EncodeError, TypeError, ValueError, ThrottleError):
        return None  # an unserializable argument: the worker's check reports it
    verdict = reply.verdict
    if ctl.recorder.enabled and verdict in (Verdict.RELEASED, Verdict.WAITS):  # (else its worker records it)
        ctl.recorder.arrived(name, call, task_id, reply.now_us, urgency)
    if verdict is Verdict.START:  # room: this one and `leased - cost` more go unchecked
        room: Cost = reply.leased - call.cost if isinstance(call.cost, int) else tuple(
            left - units for left, units in zip(reply.rooms, call.cost))
        seconds = min(shortest_us(call.rates) / 1e6, PUBLISH_HINT_MAX) if call.rates else FREE_HINT_S
        ctl.hints.open(ident, room, seconds)
        return None
    if verdict is Verdict.RELEASED:  # it fits now: it leaves with its ticket
        headers = {**(options.get("headers") or {}), HEADER: Header(ident, entry_id).value()}
        sent_options = {**options, "task_id": task_id, "headers": headers}
        if expires is not None:
            sent_options["expires"] = expires
        try:
            return send(name, args, kwargs, **sent_options)
        except Exception:
            _give_back(ctl, call, entry_id)  # (not sent: its room is not held for it)
            raise
    if verdict is Verdict.COPY:
        return _result(app, task_id, options)  # (its entry started already: not sent twice)
    if verdict is not Verdict.WAITS:
        return None  # refused (too far for its max wait, a cost that never fits), or not kept: the worker decides, visibly
    # (Kept in its line instead of the broker's queue: the journal, when on, holds its copy
    # in the broker all the same. A copy the journal refused goes to the broker's queue as
    # the task itself, naming its entry: it waits in its line all the same, and the copy is
    # told so where it arrives, or dropped if the entry ran; not sent, the caller gets the
    # broker's error, as an unthrottled send would raise it, and its entry is taken out.)
    if not ctl.lines.journal.kept(ident, entry_id, reply.now_us, kept or message(), options.get("producer")):
        try:
            return send_naming_entry()
        except Exception:
            _withdraw(ctl, call, entry_id)
            raise
    ctl.metrics.denied(call.scope, call.key, reply.wait_us / 1e6)
    request = Context(id=task_id, task=name, args=args, kwargs=kwargs, headers={HEADER: Header(deferrals=1).value()})
    signals.task_throttled.send(sender=known.task if known.task is not None else name, request=request,
                                delay=reply.wait_us / 1e6, scope=call.scope, key=call.key,
                                reason=call.wait_reason)
    return _result(app, task_id, options)


def _give_back(ctl: Throttle, call: BoundCall, entry_id: str) -> None:
    """A task released at publish that could not be sent: its room goes back (never raises:
    the send's own error stands, and the room comes back when its time is up anyway)."""
    try:
        ctl.lines.handle(call, ctl.checker.give_back(call, entry_id))
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not give back the room of task %s, which could not be sent: %r", entry_id, exc)


def _withdraw(ctl: Throttle, call: BoundCall, entry_id: str) -> None:
    """A task kept in its line at publish whose copy reached neither the journal nor the
    broker's queue: it leaves the line (its caller gets the broker's error and may send it
    again; left there, it would run as well). Never raises: the send's own error stands."""
    try:
        ctl.lines.handle(call, ctl.checker.drop(call, [entry_id]))
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not take task %s, which could not be sent, out of its line: %r", entry_id, exc)


def _absolute(expires: Any) -> datetime | None:
    """A task's ``expires`` as an aware datetime: seconds from now become a moment now."""
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        return datetime.now(timezone.utc) + timedelta(seconds=expires)
    if isinstance(expires, datetime):
        return expires if expires.tzinfo is not None else expires.replace(tzinfo=timezone.utc)
    if isinstance(expires, str):
        try:
            return _absolute(datetime.fromisoformat(expires))
        except ValueError:
            return None
    return None


def _result(app: Any, task_id: str, options: Mapping[str, Any]) -> Any:
    """The result of a task kept instead of sent, as ``send_task`` would return it."""
    result = (options.get("result_cls") or app.AsyncResult)(task_id)
    parent = app.current_worker_task
    if parent is not None and options.get("add_to_parent", True):
        parent.add_trail(result)  # (as send_task does)
    return result


def _kept_options(app: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a send that its message keeps in the line."""
    kept = {k: v for k, v in options.items() if k not in _SEND_ONLY and v is not None}
    parent = app.current_worker_task
    if parent is not None:  # what send_task would have set for a task sent from a task
        kept.setdefault("parent_id", parent.request.id)
        kept.setdefault("root_id", parent.request.root_id or parent.request.id)
    return kept
