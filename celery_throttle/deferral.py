"""How a denied task comes back: the reservation it carries, when it is sent again, and
how (re-sent with a countdown, or parked in Redis), under the store-error policy.

Shared by every place that turns a task away: the pool hook and the consumer screen
send it back (:class:`TurnedAway`); the producer at publish only plans its return.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery.exceptions import Reject

from . import signals
from .errors import StoreError
from .keys import state_tag
from .messages import encode_message
from .parking import park
from .protocol import (
    HEADER,
    Code,
    Reservation,
    WindowReply,
    header_value,
    rates_tag,
    without_dead_letter_headers,
)
from .spec import BoundCall

if TYPE_CHECKING:
    from .limiter import Throttle

__all__ = ["KEPT_PROPERTIES", "TurnedAway", "kept_properties", "plan_return"]

logger = logging.getLogger("celery_throttle")

#: Message properties a re-send carries over from the message it replaces (Celery's
#: ``signature_from_request``, as ``retry()`` uses it, rebuilds the message from the
#: request and drops them). Not ``user_id``: RabbitMQ refuses one that is not the
#: sending connection's user. Not ``expiration``: a parked or delayed message would
#: expire while it waits for its start.
KEPT_PROPERTIES = ("app_id", "type", "message_id", "timestamp")


def plan_return(ctl: Throttle, call: BoundCall, state: dict[str, Any], claim: Reservation | None,
                reply: WindowReply, held: bool = False) -> float:
    """Put the start a denial reserved in ``state`` (the task's header), and whether a
    pause ``held`` it; returns in how many seconds the task should be sent back."""
    state.pop("e", None)
    if held:
        state["p"] = 1
    else:
        state.pop("p", None)
    ident = call.state_key
    lead_us = ctl.checker.lead_us(call.rates, reply.lead_us)
    if reply.code == Code.EARLY:
        reservation = claim
        lead_us = 0  # it already came back early once: aim at the start itself
    elif reply.code == Code.RESERVED:
        lead_us = min(lead_us, reply.wait_us)  # a start closer than the lead: sent now
        reservation = Reservation(reply.start_us, reply.latest_us, call.cost, reply.grace_us,
                                  reply.epoch, lead_us, rates_tag(call.rates))
    else:
        reservation = None
    state.update(k=ident, r=reservation.to_header() if reservation else None)
    # Come back `lead` early: the reserved start is then reached in time despite the
    # broker's and the pool's dispatch delay (learnt per key, see window.lua); the
    # claim waits out the difference.
    return max(reply.wait_us - (lead_us if reservation else 0), 0) / 1e6


def kept_properties(request: Any) -> dict[str, Any]:
    """The KEPT_PROPERTIES the message of ``request`` had."""
    properties = getattr(request, "properties", None)
    if not isinstance(properties, dict):
        return {}
    return {name: properties[name] for name in KEPT_PROPERTIES if properties.get(name) is not None}


@dataclass
class TurnedAway:
    """A task a worker turned away, with what sending it back takes."""

    ctl: Throttle
    task: Any
    #: Its request (Celery's ``Context``): id, headers, routing, retries.
    request: Any
    args: Any
    kwargs: Any
    call: BoundCall
    #: Its ``celery_throttle`` header as read (:func:`read_state`); sent back updated.
    state: dict[str, Any]

    def defer(self, reply: WindowReply, claim: Reservation | None = None) -> None:
        """Send it back (or park it) to come for the start ``reply`` reserved."""
        held = self.ctl.checker.holds(self.call, reply.now_us)
        delay = plan_return(self.ctl, self.call, self.state, claim, reply, held)
        self.send_back(delay, reply.now_us, held=held)

    def send_back(self, delay: float, now_us: int | None, *, may_park: bool = True, held: bool = False) -> None:
        """Send the task again in ``delay`` seconds, same id, arguments, routing and retry
        count; park it in Redis instead when the wait is long, or a pause ``held`` it
        (``now_us``: the Redis clock's now, which parking needs). A broker that refuses
        the re-send gets the message back (``Reject`` with requeue): it is not acked as
        done."""
        ctl, task, request, call = self.ctl, self.task, self.request, self.call
        sig = self.signature()
        parked = may_park and now_us is not None and (delay >= ctl.settings.park_after or held)
        signals.task_throttled.send(sender=task, request=request, delay=delay,
                                    scope=call.scope, key=call.key, parked=parked, reason="rate")
        ctl.metrics.denied(call.scope, call.key, delay, parked)
        if parked and now_us is not None:
            try:
                park(ctl, sig, due_us=now_us + int(delay * 1e6),
                     tag=state_tag(call.scope, call.key) if held else None, now_us=now_us)
            except StoreError as exc:
                # Sent back with its countdown instead: it waits in a worker, but it is not lost.
                logger.warning("could not park %s[%s], sending it back for %.1fs instead: %s",
                               task.name, request.id, delay, exc)
                parked = False
        if not parked:
            try:
                sig.apply_async(countdown=max(delay, 0.0))
            except Exception as exc:  # any broker error: the message must not be acked as done
                logger.error("could not send %s[%s] back (%r): it is returned to the broker",
                             task.name, request.id, exc)
                raise Reject(exc, requeue=True) from exc
        back = datetime.now().astimezone() + timedelta(seconds=delay)
        logger.debug("throttled %s[%s] scope=%s key=%s: back at %s (in %.3fs%s)", task.name, request.id,
                     call.scope, call.key, back.strftime("%H:%M:%S.%f")[:-3] + back.strftime(" %Z"), delay,
                     ", parked" if parked else "")

    def signature(self) -> Any:
        """Its message to send again: same id, arguments, routing and retry count, the
        header updated (one deferral more)."""
        self.state["n"] = int(self.state.get("n") or 0) + 1  # deferrals so far, for observability
        headers = without_dead_letter_headers(self.request.headers)
        headers[HEADER] = header_value(self.state)
        return self.task.signature_from_request(self.request, self.args, self.kwargs, headers=headers,
                                                **kept_properties(self.request))

    def hold_for_pause(self, now_us: int) -> None:
        """Park it until the pause that holds its scope or key ends (or a resume sends
        it): a call with no rates, whose window would otherwise have said so."""
        end_us = self.ctl.checker.pause_end_us(self.call)
        self.state["p"] = 1
        self.send_back(max(end_us - now_us, 0) / 1e6, now_us, held=True)

    def slot_message(self) -> bytes:
        """Its message, to wait with its key's queue for a concurrency slot; the header
        says since when it waits (``w``, this host's clock in µs: its ``max_wait``)."""
        self.state.setdefault("w", int(time.time() * 1_000_000))
        return encode_message(self.ctl.app, self.signature())

    def waits_for_slot(self, running: int, waiting: int) -> None:
        """Say that it waits off the queue for a slot (it is acked; a slot handed to it
        sends it again)."""
        task, request, call = self.task, self.request, self.call
        signals.task_throttled.send(sender=task, request=request, delay=None, scope=call.scope, key=call.key,
                                    parked=True, reason="concurrency")
        self.ctl.metrics.denied(call.scope, call.key, 0.0, True)
        logger.debug("throttled %s[%s] scope=%s key=%s: waits for a concurrency slot (%d of %d running, "
                     "%d waiting)", task.name, request.id, call.scope, call.key, running, call.concurrency, waiting)

    def on_store_error(self, exc: StoreError) -> bool:
        """The check could not reach Redis: ``throttle_on_store_error`` decides. True: run
        the body now (``allow``); raises ``exc`` (``fail``); else the task is sent back
        after a growing, jittered delay (``defer``) and False is returned."""
        ctl, task, request = self.ctl, self.task, self.request
        ctl.metrics.store_error("worker")
        policy = ctl.settings.on_store_error
        if policy == "allow":
            logger.warning("throttle store unreachable, running %s[%s] unthrottled: %s",
                           task.name, request.id, exc)
            return True
        if policy == "fail":
            raise exc
        errors = int(self.state.get("e") or 0)
        self.state["e"] = errors + 1
        s = ctl.settings
        delay = min(s.store_retry_delay * 2 ** errors, s.store_retry_max_delay)
        delay *= random.uniform(0.5, 1.0)  # so deferred tasks do not return all at once
        logger.warning("throttle store unreachable, deferring %s[%s] for %.1fs: %s",
                       task.name, request.id, delay, exc)
        self.send_back(delay, None, may_park=False)
        return False
