"""How a denied task comes back: the reservation it carries and when it is sent again.

Shared by every place that turns a task away: the pool hook, the consumer screen, and
the producer at publish.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .spec import BoundCall
from .store import Code, Reservation, WindowReply, rates_tag

if TYPE_CHECKING:
    from .limiter import Throttle

__all__ = ["HEADER", "plan_return", "read_state"]

#: Message header carrying a deferred task's reservation and counters:
#: ``k`` the state key it was reserved under, ``r`` the reservation
#: (:meth:`Reservation.to_header`), ``n`` deferrals so far, ``e`` store errors in a row.
HEADER = "celery_throttle"


def read_state(value: Any) -> dict[str, Any]:
    """The header of a message as this module wrote it, from whatever it holds.

    A message may come from a foreign producer, an older version or a hand: anything
    that is not what we write counts as absent (a fresh call), field by field, and
    never raises.
    """
    if not isinstance(value, dict):
        return {}
    state: dict[str, Any] = {}
    if isinstance(value.get("k"), str):
        state["k"] = value["k"]
    reservation = Reservation.from_header(value.get("r"))
    if reservation is not None:
        state["r"] = reservation.to_header()
    for counter in ("n", "e"):
        number = value.get(counter)
        if isinstance(number, int) and not isinstance(number, bool) and 0 <= number < 2**31:
            state[counter] = number
    return state


def plan_return(ctl: Throttle, call: BoundCall, state: dict[str, Any], ident: str,
                claim: Reservation | None, reply: WindowReply) -> float:
    """Put the start a denial reserved in ``state`` (the task's header); returns in how
    many seconds the task should be sent back."""
    state.pop("e", None)
    lead_us = ctl.lead_us(call.rates, reply.lead_us)
    if reply.code == Code.EARLY:
        reservation = claim
        lead_us = 0  # it already came back early once: aim at the start itself
    elif reply.start_us:
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
