"""The journal's events, their codec, and what a pass of the keeper makes of them (pure).

The lines live in the store. With a broker that keeps messages on disk (RabbitMQ) and a
store that may not (no persistence, an eviction policy), a task that joins a line would be
less durable there than it was in its queue. So every message that joins a line is also
published to one durable queue of the broker, the journal, as a ``kept`` event (its state
key, entry id, the store's clock when it joined, the store's **epoch**, its message), and
every one that leaves its line for good (sent on to the broker, deleted) as a ``gone``
event. A task whose message the store reports gone (evicted) is a ``lost`` event.

An entry waits, as far as the journal can tell, while its **latest** event by the store's
clock is ``kept``: a task put back in its line after a release is kept again with a later
time than the release's ``gone``, whichever of the two events reached the journal first.
So events may be read in any order, and any number of times (a pass of the keeper that
died before its acks gives them back), and say the same.

The epoch is an id the store holds while it holds its lines (``keys.journal_keys``): a
store that lost them has lost it too, and has another. The keeper sends a task on only on
positive evidence that the store lost it: its ``kept`` event is of an epoch the store no
longer has (it restarted empty, or was emptied), or a ``lost`` event names it. A task the
store does not know and whose epoch it still has left its line without a word reaching
the journal (a ``gone`` whose publish failed, a process that writes none): it is dropped,
never run again. (:mod:`celery_throttle.waits.keeper` reads the journal and decides by
:func:`sort_out`.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

__all__ = ["CONTENT_TYPE", "GONE_KEEP_US", "JOURNAL_HEADER", "LOST_AFTER_US", "Event", "Kind", "Verdict",
           "decode", "entries_message", "kept_headers", "latest", "left_for_good", "sort_out", "verdict"]

#: The header that names a journal message's kind (``kept``, ``gone`` or ``lost``).
JOURNAL_HEADER = "ct-journal"
#: The content type of the journal's messages (their body is a kept message's bytes, or
#: the JSON list of a batch of entries): never one a worker would run as a task.
CONTENT_TYPE = "application/x-celery-throttle-journal"
#: A ``kept`` entry the store does not know is judged only when a pass this long (µs)
#: after the one that first found it unknown still finds it so: the ``gone`` of a task the
#: store has just deleted (an operator's purge, an expired task sent on) is published a
#: moment after the store forgot it, and reaches the journal within it.
LOST_AFTER_US = 10_000_000
#: A ``gone`` event stays in the journal this long (µs) after its time: a ``kept`` event of
#: the same entry published late (its process stalled between its call to the store and
#: its publish) still finds it there, and is not taken for a task that waits. An event
#: dated further ahead than this (a clock gone wrong) is dropped.
GONE_KEEP_US = 120_000_000
#: A ``gone`` event this old (µs) whose entry the store holds again in its line was taken
#: back by the store (a failover to a replica short of its release): the pass takes it out,
#: else its line sends it a second time. Far longer than a put-back's ``kept`` takes to
#: follow its ``gone`` (taken out then, its message would be lost); shorter than
#: GONE_KEEP_US, while the ``gone`` is still read.
TAKE_BACK_AFTER_US = 30_000_000
#: The same for an entry released and not acked (µs): its releaser died between its send
#: and its ack, or the store was taken back to before the ack; at its send lease's end
#: (10 s) it would go back to its place and be sent again. Longer than a releaser defers
#: its acks (2 s); one taken out while its ack was on its way is checked as a fresh call
#: when it arrives (its message is in the broker: nothing is lost).
TAKE_BACK_OUT_AFTER_US = 5_000_000
#: The most entries one ``gone`` or ``lost`` message names (a release sends a batch).
GONE_BATCH = 1000
#: The longest epoch id read from a message (ours are 24 hex digits).
EPOCH_MAX = 64


class Kind(str, Enum):
    KEPT = "kept"
    GONE = "gone"
    LOST = "lost"


@dataclass(frozen=True)
class Event:
    """One entry's event: ``kind``, its line's state ``key``, its ``entry`` id, ``us`` (the
    store's clock when it joined or left its line), and for ``kept``: a ``ref`` to its
    message (whatever the reader keeps it as: bytes, or where it spooled them), the store's
    ``epoch`` then, ``suspect``: when a pass first found the store did not know it (0: none
    did), and ``place``: its order among the events of one moment (tasks a pass adopted
    together, in the order of their line)."""

    kind: Kind
    key: str
    entry: str
    us: int
    ref: Any = None
    suspect: int = 0
    place: int = 0
    epoch: str = ""

    @property
    def ident(self) -> tuple[str, str]:
        return self.key, self.entry


class Verdict(str, Enum):
    """What a pass does with an entry's latest event."""

    KEEP = "keep"  # published again (its entry waits, or its gone must still be seen)
    SUSPECT = "suspect"  # published again, marked: the store does not know it (yet: a gone may follow)
    DROP = "drop"  # over: not published again
    LOST = "lost"  # it waits, and the store lost it: its message is sent on as a new task


def kept_headers(key: str, entry: str, us: int, suspect: int = 0, place: int = 0,
                 epoch: str = "") -> dict[str, Any]:
    """The headers of a ``kept`` event (its body is the message the line keeps)."""
    headers: dict[str, Any] = {JOURNAL_HEADER: Kind.KEPT.value, "key": key, "entry": entry, "us": int(us),
                               "epoch": epoch}
    if suspect:
        headers["suspect"] = int(suspect)
    if place:
        headers["place"] = int(place)
    return headers


def entries_message(kind: Kind, events: Iterable[tuple[str, str, int]]) -> tuple[dict[str, Any], bytes]:
    """The headers and body of one ``gone`` (or ``lost``) message naming ``events`` (key,
    entry, us)."""
    body = json.dumps([[key, entry, int(us)] for key, entry, us in events], separators=(",", ":"))
    return {JOURNAL_HEADER: kind.value}, body.encode()


def decode(headers: Mapping[str, Any] | None, body: Any, ref: Any = None) -> list[Event]:
    """The events of one journal message (``ref``: what a ``kept`` event's message is kept
    as). Anything else (a message of another writer, a body or field out of shape) holds
    no event: it is never taken for a task that waits."""
    headers = headers if isinstance(headers, Mapping) else {}
    kind = headers.get(JOURNAL_HEADER)
    if not isinstance(body, bytes):
        return []
    if kind == Kind.KEPT.value:
        key, entry, us = headers.get("key"), headers.get("entry"), headers.get("us")
        suspect, place, epoch = headers.get("suspect", 0), headers.get("place", 0), headers.get("epoch", "")
        if (_fields_ok(key, entry, us) and _time_ok(suspect) and _time_ok(place) and body
                and isinstance(epoch, str) and len(epoch) <= EPOCH_MAX):
            return [Event(Kind.KEPT, str(key), str(entry), int(us or 0), ref, int(suspect or 0), int(place or 0),
                          epoch)]
        return []
    if kind in (Kind.GONE.value, Kind.LOST.value):
        try:
            items = json.loads(body)
        except (ValueError, TypeError, UnicodeDecodeError):
            return []
        if not isinstance(items, list):
            return []
        return [Event(Kind(kind), *item) for item in items
                if isinstance(item, list) and len(item) == 3 and _fields_ok(*item)]
    return []


def _fields_ok(key: Any, entry: Any, us: Any) -> bool:
    return isinstance(key, str) and bool(key) and isinstance(entry, str) and bool(entry) and _time_ok(us)


def _time_ok(us: Any) -> bool:
    return isinstance(us, int) and not isinstance(us, bool) and 0 <= us < 1 << 62


def _order(event: Event) -> tuple[int, int, float]:
    # The later time; at the same time (one script's two reports), a lost mark, then kept (a
    # task put back by the call that took it out still waits), then gone; one event read
    # twice (a pass that died before its acks), the copy least ready to be taken for lost:
    # never marked, else marked last.
    rank = {Kind.GONE: 0, Kind.KEPT: 1, Kind.LOST: 2}[event.kind]
    return event.us, rank, float("inf") if not event.suspect else event.suspect


def later(a: Event, b: Event) -> bool:
    """Whether ``a`` comes after ``b`` for the same entry."""
    return _order(a) > _order(b)


def latest(events: Iterable[Event]) -> dict[tuple[str, str], Event]:
    """Each entry's latest event."""
    found: dict[tuple[str, str], Event] = {}
    for event in events:
        seen = found.get(event.ident)
        if seen is None or later(event, seen):
            found[event.ident] = event
    return found


def verdict(event: Event, known: bool, now_us: int, epoch: str) -> Verdict:
    """What a pass does with an entry's latest ``event`` (not a ``lost`` mark: see
    :func:`sort_out`). ``known``: whether the store holds its entry (waiting in its line,
    released and not started, or started lately); ``epoch``: the store's now."""
    if event.us > now_us + GONE_KEEP_US:
        return Verdict.DROP  # (dated far ahead: a clock gone wrong)
    if event.kind == Kind.GONE:
        return Verdict.KEEP if now_us - event.us < GONE_KEEP_US else Verdict.DROP
    if known:
        return Verdict.KEEP
    if not event.suspect or now_us - event.suspect < LOST_AFTER_US:
        return Verdict.SUSPECT
    # (Unknown at two looks: lost with the store of its epoch, or gone without a word.)
    return Verdict.LOST if event.epoch != epoch else Verdict.DROP


def left_for_good(events: Iterable[Event], now_us: int, after_us: int) -> list[Event]:
    """The ``gone`` events of entries that left their lines for good ``after_us`` or more
    ago, and less than GONE_KEEP_US: each entry's latest event, later than any ``kept`` of
    it (one put back after its release is kept again, later). A store that holds one of
    them again was taken back (:meth:`.Pass._take_back`)."""
    return [event for event in latest(events).values()
            if event.kind == Kind.GONE and after_us <= now_us - event.us < GONE_KEEP_US]


def sort_out(events: Iterable[Event], known: Callable[[Iterable[tuple[str, str]]], set[tuple[str, str]]],
             now_us: int, epoch: str) -> tuple[list[Event], list[Event]]:
    """A pass over ``events`` (every event the journal held as it began): (the events to
    publish again, the ``kept`` events of tasks the store lost), each in the order of
    their times. ``known`` answers which of the entries it is given the store holds;
    ``epoch`` is the store's now. An entry whose latest event is a ``lost`` mark is sent on
    from its latest ``kept`` event, if the pass read one; else the mark stays (GONE_KEEP_US)
    for a kept event published late."""
    events = list(events)
    found = latest(events)
    kept = latest(e for e in events if e.kind == Kind.KEPT)
    gone = latest(e for e in events if e.kind == Kind.GONE)
    held = known([event.ident for event in found.values() if event.kind == Kind.KEPT])
    again: list[Event] = []
    lost: list[Event] = []
    for event in sorted(found.values(), key=lambda e: (e.us, e.place, e.key, e.entry)):
        if event.kind == Kind.LOST:
            copy = kept.get(event.ident)
            if event.us > now_us + GONE_KEEP_US:
                continue  # (dated ahead: a clock gone wrong)
            left = gone.get(event.ident)
            if copy is not None and left is not None and later(left, copy):
                # It left its line for good after its copy was kept (sent to the broker):
                # a store that failed over to a replica short of that may hold it again
                # and then find its message gone; sent on, it would run twice.
                copy = None
            if copy is not None:
                lost.append(copy)
            elif now_us - event.us < GONE_KEEP_US:  # (its kept, published late, may come yet)
                again.append(event)
            continue
        what = verdict(event, event.ident in held, now_us, epoch)
        if what == Verdict.KEEP:
            again.append(replace(event, suspect=0))
        elif what == Verdict.SUSPECT:
            again.append(replace(event, suspect=event.suspect or now_us))
        elif what == Verdict.LOST:
            lost.append(event)
    return again, sorted(lost, key=lambda e: (e.us, e.place, e.key, e.entry))
