"""The ``celery_throttle`` message header: what a deferred task carries with it (the
start it reserved, its counters), as this version writes it and reads any value."""

from __future__ import annotations

from typing import Any

from .store import Reservation

__all__ = ["DEAD_LETTER_HEADERS", "HEADER", "read_state", "without_dead_letter_headers"]

#: Message header carrying a deferred task's reservation and counters:
#: ``k`` the state key it was reserved under, ``r`` the reservation
#: (:meth:`Reservation.to_header`), ``n`` deferrals so far, ``e`` store errors in a row,
#: ``p`` 1 if a pause held it (it was parked, for a resume to send it at once).
HEADER = "celery_throttle"


#: Headers RabbitMQ adds to a message it dead-letters, as the delay topology of broker
#: parking does at each hop (the names Celery's own retry() drops, X_DEATH_HEADERS). A
#: re-send that kept them would pass the same delay queue a second time with them, which
#: RabbitMQ takes for a dead-letter cycle and drops the message, without a word.
DEAD_LETTER_HEADERS = frozenset({"x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
                                 "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason"})


def without_dead_letter_headers(headers: Any) -> dict[str, Any]:
    """A copy of a message's headers without DEAD_LETTER_HEADERS."""
    if not isinstance(headers, dict):
        return {}
    return {name: value for name, value in headers.items() if name not in DEAD_LETTER_HEADERS}


def read_state(value: Any) -> dict[str, Any]:
    """The header of a message as this version wrote it, from whatever it holds.

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
    for counter in ("n", "e", "p"):
        number = value.get(counter)
        if isinstance(number, int) and not isinstance(number, bool) and 0 <= number < 2**31:
            state[counter] = number
    return state
