"""The ``celery_throttle`` message header: what a task the throttle let go carries, read
field by field from whatever a message holds (:meth:`Header.read`) and written by
:meth:`Header.value`, its one codec; versioned by :data:`HEADER_VERSION` (CHANGELOG.md
records each change of it). And the headers a re-send drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEAD_LETTER_HEADERS", "HEADER", "HEADER_VERSION", "Header", "without_dead_letter_headers"]

#: Message header of a task the throttle let go after it waited: its ticket, and counters.
HEADER = "celery_throttle"
#: The header's format as this version writes it, and the only one it reads: the first
#: release's, where the next release's upgrade path starts (formats 1 and 2 were
#: development versions, never released). A header of another format (a deploy rolled
#: back while a later version's messages wait) is read as absent: a fresh call, behind its
#: key's line. CHANGELOG.md records each format.
HEADER_VERSION = 3
#: The most deferrals and store errors in a row a header counts (a counter that reads
#: more, written by hand, counts this many).
_COUNTER_MAX = 1 << 20


@dataclass(frozen=True)
class Header:
    """The ``celery_throttle`` header: ``key``, the state key of the line the task was
    released from, and ``ticket``, its entry there (both "" for none); ``deferrals``, how
    many times it was turned away (observability); ``errors``, store errors in a row (its
    back-off); ``pending``, the entry it may hold in the line of ``key`` already (a call
    that put it there, whose reply was lost: the store went away mid-call), so that it is
    not let in twice; ``lost``, the holder (a delivery id) of that call, should the store
    have started the entry in its name: the copy that names it is that task, which ran
    nothing, not a copy of one that ran. Every field is read from whatever a message holds: anything that is
    not what this version writes counts as absent, field by field, and never raises.
    Nothing in it grants anything by itself: a ticket is one the store holds out, a
    pending entry one it holds waiting, and a lost holder only makes a copy a fresh call
    (behind the line, counted), once."""

    key: str = ""
    ticket: str = ""
    deferrals: int = 0
    errors: int = 0
    pending: str = ""
    lost: str = ""

    @property
    def arrives(self) -> bool:
        """Whether a task with this header comes to its throttle for the first time (never
        deferred, released, nor sent again after a store error): its arrival, for the record."""
        return not (self.ticket or self.pending or self.deferrals or self.errors)

    @classmethod
    def read(cls, value: Any) -> Header:
        if not isinstance(value, dict):
            return _EMPTY
        version = value.get("v")
        if not isinstance(version, int) or isinstance(version, bool) or version != HEADER_VERSION:
            return _EMPTY
        return cls(_text(value.get("k")), _text(value.get("t")), _counter(value.get("n")), _counter(value.get("e")),
                   _text(value.get("i")), _text(value.get("l")))

    def value(self) -> dict[str, Any]:
        """The header to send."""
        out: dict[str, Any] = {"v": HEADER_VERSION, "n": self.deferrals}
        if self.key:
            out["k"] = self.key
        if self.ticket:
            out["t"] = self.ticket
        if self.errors:
            out["e"] = self.errors
        if self.pending:
            out["i"] = self.pending
        if self.lost:
            out["l"] = self.lost
        return out


_EMPTY = Header()
#: The longest key or ticket a header is read with (a state key is bounded: keys.MAX_TOKEN).
_TEXT_MAX = 1024


def _text(value: Any) -> str:
    return value if isinstance(value, str) and len(value) <= _TEXT_MAX else ""


def _counter(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return min(value, _COUNTER_MAX)
    return 0


#: Headers RabbitMQ adds to a message it dead-letters, as the delay topology of Celery's
#: native delayed delivery (a countdown on quorum queues) does at each hop (the names
#: Celery's own retry() drops, X_DEATH_HEADERS). A re-send that kept them would pass the
#: same delay queue a second time with them, which RabbitMQ takes for a dead-letter cycle
#: and drops the message, without a word.
DEAD_LETTER_HEADERS = frozenset({"x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
                                 "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason"})


def without_dead_letter_headers(headers: Any) -> dict[str, Any]:
    """A copy of a message's headers without DEAD_LETTER_HEADERS."""
    if not isinstance(headers, dict):
        return {}
    return {name: value for name, value in headers.items() if name not in DEAD_LETTER_HEADERS}
