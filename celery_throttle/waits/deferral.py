"""A task a worker could not start now: what it takes to put it in its key's line (its
entry and message), to say it waits, and what happens when the store cannot be reached.

Shared by every place that turns a task away in a worker: the pool hook and the consumer
screen (:class:`TurnedAway`). Publish builds its entries itself (it has no request).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery.exceptions import Reject

from .. import signals
from ..celery_parts.messages import encode_message, message_urgency
from ..check.slots import is_nonce, nonce_of
from ..core.errors import ResendRefused
from ..core.header import HEADER, Header, without_dead_letter_headers
from ..core.keys import encode
from ..core.locks import ForkSafeLock
from ..core.protocol import Entry, WindowReply
from ..core.spec import BoundCall
from ..core.timing import RESEND_PATIENCE, RESEND_RETRY_DELAY, RESEND_RETRY_MAX_DELAY, WORKER_BATCH

if TYPE_CHECKING:
    from ..check.lines import Lines
    from ..check.setup import Setup

__all__ = ["KEPT_PROPERTIES", "TurnedAway", "expires_us", "kept_properties", "names_task",
           "new_entry_id", "own_header", "redelivered"]

logger = logging.getLogger("celery_throttle")

#: Message properties a re-send carries over from the message it replaces (Celery's
#: ``signature_from_request``, as ``retry()`` uses it, rebuilds the message from the
#: request and drops them). Not ``user_id``: RabbitMQ refuses one that is not the
#: sending connection's user. Not ``expiration``: the task's ``expires`` holds instead.
KEPT_PROPERTIES = ("app_id", "type", "message_id", "timestamp")
#: The most store errors in a row that still double a task's back-off (its delay is capped
#: by ``throttle_store_retry_max_delay`` long before; the count itself goes on).
_BACKOFF_DOUBLINGS = 30


def new_entry_id(task_id: str) -> str:
    """An entry id for a task joining a line: its task id (encoded: any id is a key), so
    that ``throttle why`` finds it, and 96 random bits, so that nobody who has not been
    handed it can name it: it is the task's ticket once released."""
    return f"{encode(task_id)}:{secrets.token_hex(12)}"


def names_task(entry: str, task_id: str) -> bool:
    """Whether ``entry`` (a ticket, or a pending entry, as a header carries it) is one made
    for ``task_id`` (:func:`new_entry_id`): a header copied onto another task names none of
    its entries, and that task is a new one, not a copy of the task it was copied from."""
    return entry.startswith(f"{encode(task_id)}:")


def own_header(header: Header, task_id: str) -> Header:
    """``header`` with its ticket, pending entry and lost holder only where they name
    entries and deliveries of ``task_id``: what a message of that task may use of it."""
    ticket = header.ticket if names_task(header.ticket, task_id) else ""
    pending = header.pending if names_task(header.pending, task_id) else ""
    lost = header.lost if is_nonce(header.lost) else ""
    if (ticket, pending, lost) == (header.ticket, header.pending, header.lost):
        return header
    return dataclasses.replace(header, ticket=ticket, pending=pending, lost=lost)


def expires_us(expires: Any) -> int:
    """A task's ``expires`` (an ISO 8601 string as a request carries it, a datetime, or
    seconds from now) as µs of the wall clock; 0 for none or anything else."""
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        return int((datetime.now(timezone.utc).timestamp() + expires) * 1_000_000)
    if isinstance(expires, str):
        try:
            expires = datetime.fromisoformat(expires)
        except ValueError:
            return 0
    if isinstance(expires, datetime):
        if expires.tzinfo is None:
            expires = expires.replace(tzinfo=timezone.utc)
        return int(expires.timestamp() * 1_000_000)
    return 0


def kept_properties(request: Any) -> dict[str, Any]:
    """The KEPT_PROPERTIES the message of ``request`` had."""
    properties = getattr(request, "properties", None)
    if not isinstance(properties, dict):
        return {}
    return {name: properties[name] for name in KEPT_PROPERTIES if properties.get(name) is not None}


class _Refusals:
    """The broker's refusals of this process's re-sends, in a row, whatever task each was
    for: after each one the next try waits longer (RESEND_RETRY_DELAY, doubling, jittered,
    up to RESEND_RETRY_MAX_DELAY), so that a broker that refuses every re-send, and hands
    each message straight back, is not met with a check and a re-send per round trip."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self.in_a_row = 0
        self._next_try = 0.0  # (monotonic)

    def pause(self) -> float:
        """How long (seconds) the next try must wait."""
        with self._lock:
            return max(self._next_try - time.monotonic(), 0.0) if self.in_a_row else 0.0

    def refused(self) -> int:
        """Count a refusal; returns how many came in a row."""
        with self._lock:
            self.in_a_row += 1
            delay = min(RESEND_RETRY_DELAY * 2 ** min(self.in_a_row - 1, _BACKOFF_DOUBLINGS), RESEND_RETRY_MAX_DELAY)
            self._next_try = time.monotonic() + delay * random.uniform(0.5, 1.0)
            return self.in_a_row

    def accepted(self) -> None:
        with self._lock:
            self.in_a_row = 0


_refusals = _Refusals()


@dataclass
class TurnedAway:
    """A task a worker could not start now, with what putting it in its line takes."""

    setup: Setup
    lines: Lines
    task: Any
    #: Its request (Celery's ``Context``): id, headers, routing, retries.
    request: Any
    args: Any
    kwargs: Any
    call: BoundCall
    #: Its ``celery_throttle`` header as read.
    header: Header
    #: Its entry id, should it join the line (made once per delivery).
    entry_id: str = field(default="")
    #: The longest it may wait (µs; 0: no cap).
    max_wait_us: int = 0
    #: The holder its calls are made in the name of (a slot's; a start the store records
    #: names its nonce): a re-send after a lost reply names that nonce, and is made in a
    #: holder of the same nonce, so that the store can tell that start never ran.
    holder: str = ""
    #: Its message as last given to its line (the journal keeps a copy of it).
    kept_message: bytes = field(default=b"", repr=False)

    def entry(self, with_message: bool) -> Entry:
        """Its entry in the line (with its message, or without: the script then answers
        DENIED where it would wait, and the caller calls again with it). Its id: its ticket
        (released from this line), or the entry a lost reply may have left it (its header's
        ``pending``), so that it never waits twice; else a new one."""
        if not self.entry_id:
            header, mine = self.header, self.header.key == self.call.state_key
            self.entry_id = (mine and (header.ticket or header.pending)) or new_entry_id(self.request.id)
        if with_message:
            self.kept_message = self.message()
        lost = self.header.lost if self.header.key == self.call.state_key else ""
        return Entry(self.entry_id, self.kept_message if with_message else b"", self.request.id,
                     expires_us(getattr(self.request, "expires", None)), self.max_wait_us, WORKER_BATCH, lost,
                     self.urgency())

    def urgency(self) -> int:
        return urgency_of(self.setup.app, self.call, self.request)

    def message(self) -> bytes:
        """Its message as the line keeps it: same id, arguments, routing, retry count and
        ``expires``, its header counting one deferral more (no ticket: it is given one
        when it is released)."""
        return encode_message(self.setup.app, self.signature(Header(deferrals=self.header.deferrals + 1,
                                                                  errors=self.header.errors)))

    def signature(self, header: Header) -> Any:
        """Its message to send again, with ``header``."""
        headers = without_dead_letter_headers(self.request.headers)
        headers[HEADER] = header.value()
        return self.task.signature_from_request(self.request, self.args, self.kwargs, headers=headers,
                                                **kept_properties(self.request))

    def waits(self, reply: WindowReply, reason: str | None = None) -> bool:
        """It waits in its key's line (``reply``: the call that put it there, or kept it
        there): its copy goes to the journal, before its message is acked (its release
        sends it again), and it is said (``reason``: the call's own, see
        :attr:`.BoundCall.wait_reason`, unless told). False: the journal refused its copy,
        and its message must not be acked as kept (:meth:`waits_in_pool`; the consumer
        hands it to the pool)."""
        task, request, call = self.task, self.request, self.call
        reason = reason or call.wait_reason
        journaled = self.lines.journal.kept(call.state_key, self.entry_id, reply.now_us,
                                            self.kept_message or self.message())
        delay = max(reply.wait_us, 0) / 1e6
        signals.task_throttled.send(sender=task, request=request, delay=delay, scope=call.scope, key=call.key,
                                    reason=reason)
        self.setup.metrics.denied(call.scope, call.key, delay)
        logger.debug("throttled %s[%s] scope=%s key=%s: waits in its line (about %.3fs)", task.name, request.id,
                     call.scope, call.key, delay)
        return journaled

    def waits_in_pool(self, reply: WindowReply, reason: str | None = None) -> None:
        """:meth:`waits`, in the pool: a task whose copy the journal refused is sent back to
        the broker for its wait, naming its entry (:meth:`send_back`), so that the broker
        holds it as it held its message; arriving while its entry waits, it is told it
        waits there, and after it ran, it is dropped as a copy."""
        if not self.waits(reply, reason):
            self.send_back(max(reply.wait_us, 0) / 1e6)

    def send_back(self, delay: float) -> None:
        """Send it again in ``delay`` seconds (it waits in a worker meanwhile): same id,
        arguments, routing and retry count. A refused re-send is never acked as done: see
        :meth:`_resend`."""
        # (It names the entry a call whose reply was lost may have left it in its line.)
        sig = self.signature(Header(self.call.state_key, "", self.header.deferrals + 1, self.header.errors,
                                    self.entry_id, self.header.lost))
        self._resend(sig, delay)

    def on_store_error(self, exc: Exception) -> bool:
        """The check could not reach Redis: ``throttle_on_store_error`` decides. True: run
        the body now (``allow``); raises ``exc`` (``fail``); else the task is sent back
        after a growing, jittered delay (``defer``) and False is returned."""
        setup, task, request = self.setup, self.task, self.request
        setup.metrics.store_error("worker")
        policy = setup.settings.on_store_error
        if policy == "allow":
            logger.warning("throttle store unreachable, running %s[%s] unthrottled: %s", task.name, request.id, exc)
            return True
        if policy == "fail":
            raise exc
        h = self.header
        s = setup.settings
        delay = min(s.store_retry_delay * 2 ** min(h.errors, _BACKOFF_DOUBLINGS), s.store_retry_max_delay)
        delay *= random.uniform(0.5, 1.0)  # so deferred tasks do not return all at once
        logger.warning("throttle store unreachable, deferring %s[%s] for %.1fs: %s", task.name, request.id, delay, exc)
        # (It keeps its ticket, and names the entry the failed call may have left it, and
        # the nonce of the holder it was made in: should the store have started it in that
        # name, the reply lost, it never ran, and its copy must not be dropped as one of a
        # task that ran. The copy makes its calls in a holder of that nonce, so a chain of
        # lost replies names one nonce throughout.)
        mine = h.key == self.call.state_key
        ticket, entry = (h.ticket if mine else ""), self.entry_id or (h.pending if mine else "")
        if ticket and redelivered(request):
            # (The broker gave this message back: its worker may have died holding the start
            # granted to its ticket, and the pool checks such a delivery as a new task, never
            # dropping it as a copy. Its copy sent now is no redelivery: it goes as the new
            # task it was being checked as, without the ticket and under an entry of its own,
            # or it would be dropped as a copy of the start its dead worker held.)
            ticket = ""
            entry = entry if entry and entry != h.ticket else new_entry_id(request.id)
        sig = self.signature(Header(self.call.state_key, ticket, h.deferrals + 1, h.errors + 1, entry,
                                    nonce_of(self.holder) or (h.lost if mine else "")))
        self._resend(sig, delay)
        return False

    def _resend(self, sig: Any, delay: float) -> None:
        """Send ``sig`` to run in ``delay`` seconds, after the pause this process's last
        refusals ask for. A refusal: with ``acks_late`` the message is still the broker's
        and goes back to it (``Reject`` with requeue; its next delivery here waits out the
        pause first); without, it was acked when the pool took it and this is its only
        copy: tried again, backing off, for RESEND_PATIENCE, then :class:`ResendRefused`."""
        task, request = self.task, self.request
        kept_by_broker = bool(getattr(task, "acks_late", False))
        began = time.monotonic()
        while True:
            pause = _refusals.pause()
            if pause:
                time.sleep(pause)
            try:
                sig.apply_async(countdown=max(delay - (time.monotonic() - began), 0.0))
            except Exception as exc:  # any broker error: the message must not be acked as done
                in_a_row = _refusals.refused()
                if kept_by_broker:
                    logger.error("the broker refused to take %s[%s] back (%r; %d refusals in a row here): it is "
                                 "returned to the broker", task.name, request.id, exc, in_a_row)
                    raise Reject(exc, requeue=True) from exc
                tried = time.monotonic() - began
                if tried + _refusals.pause() > RESEND_PATIENCE:
                    logger.error("the broker refused to take %s[%s] back for %.0fs (%r): its message was acked when "
                                 "it started (acks_late is off), so the task fails", task.name, request.id, tried, exc)
                    raise ResendRefused(f"the broker refused to take {task.name}[{request.id}] back for "
                                        f"{tried:.0f}s: {exc!r}") from exc
                logger.error("the broker refused to take %s[%s] back (%r; %d refusals in a row here): trying again "
                             "in %.1fs", task.name, request.id, exc, in_a_row, _refusals.pause())
                continue
            _refusals.accepted()
            return


def urgency_of(app: Any, call: BoundCall, request: Any) -> int:
    """Where a task joins its line: by its throttle's ``priority=``, else by its message's."""
    if call.priority is not None:
        return call.priority
    delivery = getattr(request, "delivery_info", None) or {}
    return message_urgency(app, delivery.get("priority") if isinstance(delivery, dict) else None)


def redelivered(request: Any) -> bool:
    """Whether the broker gave this message back (its worker died, or lost its connection,
    before acking it)."""
    return bool((getattr(request, "delivery_info", None) or {}).get("redelivered"))
