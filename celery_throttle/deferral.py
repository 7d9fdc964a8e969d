"""How a denied task comes back: the reservation it carries and when it is sent again.

Shared by every place that turns a task away: the pool hook, the consumer screen, and
the producer at publish.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .spec import BoundCall
from .store import Reservation, WindowReply

if TYPE_CHECKING:
    from .limiter import Throttle

__all__ = ["HEADER", "plan_return"]

#: Message header carrying a deferred task's reservation and counters.
HEADER = "celery_throttle"


def plan_return(ctl: Throttle, call: BoundCall, state: dict[str, Any], ident: str,
                claim: Reservation | None, reply: WindowReply) -> float:
    """Put the start a denial reserved in ``state`` (the task's header); returns in how
    many seconds the task should be sent back."""
    state.pop("e", None)
    lead_us = ctl.lead_us(call.rates, reply.lead_us)
    if reply.code == WindowReply.EARLY:
        reservation = claim
        lead_us = 0  # it already came back early once: aim at the start itself
    elif reply.start_us:
        lead_us = min(lead_us, reply.wait_us)  # a start closer than the lead: sent now
        reservation = Reservation(reply.start_us, reply.latest_us, call.cost, reply.grace_us,
                                  reply.epoch, lead_us)
    else:
        reservation = None
    state.update(k=ident, r=reservation.to_header() if reservation else None)
    # Come back `lead` early: the reserved start is then reached in time despite the
    # broker's and the pool's dispatch delay (learnt per key, see window.lua); the
    # claim waits out the difference.
    return max(reply.wait_us - (lead_us if reservation else 0), 0) / 1e6
