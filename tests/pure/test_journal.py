"""The journal's events and the keeper's passes, against a model of the lines (pure).

A world of entries that join lines, are released, put back, started and dropped, with the
store's clock; each change published to the journal a little late (a process between its
call to the store and its publish), passes of the keeper now and then (one that dies
after it published again and before its acks, so its events are read twice), and stores
that lose everything. Whatever the order: a task that waited when its store was lost is
sent on exactly once, no other ever is, and the journal keeps nothing else for long.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import find, given, settings

from celery_throttle.core import journal
from celery_throttle.core.journal import (
    GONE_KEEP_US,
    LOST_AFTER_US,
    Event,
    Kind,
    decode,
    entries_message,
    kept_headers,
    left_for_good,
)
from tests.helpers import QUICK

#: How long a started entry stays known to the store (line.lua's USED_KEEP_MS), and one
#: released that never arrives (OUT_LEASE_MS).
USED_KEEP_US = OUT_LEASE_US = 600_000_000
#: The latest a change reaches the journal after the store made it: a gone well within
#: LOST_AFTER (it follows its script at once), a kept within GONE_KEEP (a stalled process).
GONE_LATE_US, KEPT_LATE_US = LOST_AFTER_US // 2, GONE_KEEP_US // 2
KEY = "throttle:{scope:acme}"


@dataclass
class World:
    """The store's lines, the journal's messages (each with when it arrives) and what the
    keeper sent on."""

    now: int = 1_000_000
    waiting: set[str] = field(default_factory=set)
    out: dict[str, int] = field(default_factory=dict)  # entry -> when it was released
    used: dict[str, int] = field(default_factory=dict)  # entry -> when it started
    journal: list[tuple[int, Event]] = field(default_factory=list)
    #: Entries waiting when a store was lost (each must be sent on once), and those sent on.
    lost: list[str] = field(default_factory=list)
    sent_on: list[str] = field(default_factory=list)
    #: Entries the world is done with (finished, or handed to the broker at a loss).
    done: set[str] = field(default_factory=set)
    count: int = 0
    #: The store's epoch (a new one at each loss), and the entries it notes the keeper sent on.
    epoch: int = 0
    marks: set[str] = field(default_factory=set)
    #: Entries that left their lines without a word to the journal, and those of them whose
    #: copy a loss found still there: such a one may be sent on (never twice), the price of
    #: two faults (its gone unwritten, then the store lost).
    silent: set[str] = field(default_factory=set)
    maybe: set[str] = field(default_factory=set)

    def publish(self, kind: Kind, entry: str, late: int) -> None:
        epoch = f"ep{self.epoch}" if kind == Kind.KEPT else ""
        self.journal.append((self.now + late, Event(kind, KEY, entry, self.now, ref=entry, epoch=epoch)))

    def known(self, idents: Any) -> set[tuple[str, str]]:
        return {(k, e) for k, e in idents
                if e in self.waiting or (e in self.out and self.now - self.out[e] < OUT_LEASE_US)
                or (e in self.used and self.now - self.used[e] < USED_KEEP_US)}

    def keeper_pass(self, dies: str) -> None:
        """A pass; ``dies``: "" (it does not), "before" its sends (after publishing again),
        "after" them (before its acks): every event it read stays too."""
        arrived = [event for at, event in self.journal if at <= self.now]
        later = [(at, event) for at, event in self.journal if at > self.now]
        again, lost = journal.sort_out(arrived, self.known, self.now, f"ep{self.epoch}")
        republished = [(self.now, event) for event in again]
        if dies != "before":
            for event in lost:  # (the store notes each before it is sent; a gone after)
                if event.entry not in self.marks:
                    self.marks.add(event.entry)
                    self.sent_on.append(event.entry)
                    republished.append((self.now, Event(Kind.GONE, KEY, event.entry, self.now)))
        if dies:
            self.journal = [(at, e) for at, e in self.journal if at <= self.now] + republished + later
            return
        self.journal = republished + later


def run(ops: list[tuple[Any, ...]]) -> World:
    """The world after ``ops``, then time enough for every event to arrive and age, with a
    pass now and then."""
    w = World()
    for op, *args in ops:
        w.now += 1  # (each call of the store reads its clock anew)
        if op == "park":
            w.count += 1
            entry = f"e{w.count}"
            w.waiting.add(entry)
            w.publish(Kind.KEPT, entry, args[0] % KEPT_LATE_US)
        elif op in ("release", "drop", "silent drop", "evict") and w.waiting:
            entry = sorted(w.waiting)[args[0] % len(w.waiting)]
            w.waiting.discard(entry)
            if op == "release":
                w.out[entry] = w.now
            else:
                w.done.add(entry)
            if op == "evict":  # (its message gone from the store: the releaser reports it)
                w.lost.append(entry)
                w.publish(Kind.LOST, entry, args[1] % GONE_LATE_US)
            elif op != "silent drop":  # (a purge whose gone never reached the journal)
                w.publish(Kind.GONE, entry, args[1] % GONE_LATE_US)
            else:
                w.silent.add(entry)
        elif op in ("put_back", "start") and w.out:
            entry = sorted(w.out)[args[0] % len(w.out)]
            del w.out[entry]
            if op == "put_back":
                w.waiting.add(entry)
                w.publish(Kind.KEPT, entry, args[1] % KEPT_LATE_US)
            else:
                w.used[entry] = w.now
                w.done.add(entry)
        elif op == "advance":
            w.now += args[0]
        elif op == "pass":
            w.keeper_pass(dies=args[0])
        elif op == "loss":
            # The store restarts empty: what waited must be sent on from the journal; what
            # was released is in the broker already (it arrives as a new task).
            w.lost.extend(sorted(w.waiting))
            w.maybe |= {e.entry for _, e in w.journal if e.entry in w.silent}
            w.done |= w.waiting | set(w.out)
            w.waiting, w.out, w.used, w.marks = set(), {}, {}, set()
            w.epoch += 1
    for _ in range(4):  # (every event arrives and ages past what keeps it)
        w.now += GONE_KEEP_US + USED_KEEP_US
        w.keeper_pass(dies="")
    return w


delays = st.integers(0, 10 * GONE_KEEP_US)
operations = st.lists(st.one_of(
    st.tuples(st.just("park"), delays),
    st.tuples(st.sampled_from(["release", "drop", "silent drop", "evict", "put_back", "start"]), st.integers(0, 50),
              delays),
    st.tuples(st.just("advance"), st.sampled_from([1, 1_000, LOST_AFTER_US, GONE_KEEP_US, USED_KEEP_US])),
    st.tuples(st.just("pass"), st.sampled_from(["", "", "before", "after"])),
    st.tuples(st.just("loss")),
), max_size=60)


def broken(w: World) -> str | None:
    """The promise ``w`` breaks, if any."""
    sent = set(w.sent_on)
    if len(sent) != len(w.sent_on) or not set(w.lost) <= sent <= set(w.lost) | w.maybe:
        return f"sent on {sorted(w.sent_on)}, lost {sorted(w.lost)} (and maybe {sorted(w.maybe)})"
    left = sorted(e.entry for _, e in w.journal if e.kind == Kind.KEPT)
    if left != sorted(w.waiting):  # (what the world still has waiting, once each)
        return f"the journal keeps {left}, the lines hold {sorted(w.waiting)}"
    return None


@settings(max_examples=100 if QUICK else 600, deadline=None)
@given(operations)
def test_a_task_waiting_when_its_store_is_lost_is_sent_on_once_and_no_other_ever(ops: list[tuple[Any, ...]]) -> None:
    # Given any life of the lines, with events late, passes that die before their acks,
    # and stores lost; when every event has arrived and aged
    w = run(ops)
    # Then each task that waited at a loss was sent on once, no other was, and the
    # journal holds one event for each task still waiting, and nothing else
    assert broken(w) is None, broken(w)


@pytest.mark.parametrize("mutation", ["known ignored", "latest by arrival", "gone forgotten at once",
                                      "lost at the first look", "epoch ignored"])
def test_the_model_catches_a_keeper_that_sends_on_too_much_or_too_little(
        mutation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a keeper with one of its rules broken
    if mutation == "known ignored":  # (the store's word not asked: old waits look lost)
        real = journal.verdict
        monkeypatch.setattr(journal, "verdict", lambda event, known, now, epoch: real(event, False, now, epoch))
    elif mutation == "latest by arrival":  # (the last event read wins, not the latest time)
        def by_arrival(events: Any) -> dict[tuple[str, str], Event]:
            return {event.ident: event for event in events}
        monkeypatch.setattr(journal, "latest", by_arrival)
    elif mutation == "gone forgotten at once":  # (a kept published late finds no gone)
        monkeypatch.setattr(journal, "GONE_KEEP_US", 0)
    elif mutation == "lost at the first look":  # (a purge's gone may not be there yet)
        monkeypatch.setattr(journal, "LOST_AFTER_US", 0)
    else:  # (unknown to the store taken for lost: a purge whose gone was never written runs)
        real = journal.verdict
        monkeypatch.setattr(journal, "verdict", lambda event, known, now, epoch: real(event, known, now, "another"))
    # Then the model finds a life of the lines where it breaks a promise
    found = find(operations, lambda ops: broken(run(ops)) is not None, settings=settings(max_examples=20_000,
                                                                                         deadline=None))
    assert broken(run(found)) is not None


def test_events_read_back_as_written_and_nothing_else_is_an_event() -> None:
    # Given a kept and a gone message as the writers write them
    kept = decode(kept_headers(KEY, "e1", 5), b"message", ref=7)
    headers, body = entries_message(Kind.GONE, [(KEY, "e1", 6), (KEY, "e2", 6)])
    # Then they read back as their events
    assert kept == [Event(Kind.KEPT, KEY, "e1", 5, 7)]
    lost_headers, lost_body = entries_message(Kind.LOST, [(KEY, "e3", 7)])
    assert [(e.kind, e.entry) for e in decode(lost_headers, lost_body)] == [(Kind.LOST, "e3")]
    assert [(e.kind, e.entry, e.us) for e in decode(headers, body)] == [(Kind.GONE, "e1", 6), (Kind.GONE, "e2", 6)]
    # And anything else holds no event: another writer's message, fields out of shape
    for other_headers, other_body in [({}, b"x"), (None, b"x"), ({"ct-journal": "kept", "key": KEY, "entry": "e",
                                                                   "us": True}, b"x"),
                                      (kept_headers(KEY, "e", -1), b"x"), (kept_headers(KEY, "e", 1), b""),
                                      (headers, b"not json"), (headers, b'{"a": 1}'), (headers, b"[[1, 2, 3], 4]")]:
        assert decode(other_headers, other_body) == []


def test_a_task_put_back_after_its_release_is_kept_whichever_event_comes_first() -> None:
    # Given a task released at 10 and put back at 11, the put-back's event read first
    events = [Event(Kind.KEPT, KEY, "e", 11), Event(Kind.KEPT, KEY, "e", 1), Event(Kind.GONE, KEY, "e", 10)]
    # Then it waits, as far as the journal can tell
    assert journal.latest(events)[(KEY, "e")].us == 11
    assert journal.latest(reversed(events))[(KEY, "e")].us == 11


@pytest.mark.parametrize(("events", "sent"), [
    # Kept at 1, released to the broker at 10; a store that failed over to a replica short
    # of the release holds it in its line again, and finds its message gone at 20: it
    # went out at 10, and sent on it would run twice
    ([(Kind.KEPT, 1), (Kind.GONE, 10), (Kind.LOST, 20)], False),
    # Put back in its place at 11 (it waits again): its message lost at 20, it is sent on
    ([(Kind.KEPT, 1), (Kind.GONE, 10), (Kind.KEPT, 11), (Kind.LOST, 20)], True),
    # Never released: sent on
    ([(Kind.KEPT, 1), (Kind.LOST, 20)], True),
])
def test_a_task_reported_lost_is_sent_on_only_if_it_waited_since_it_last_left(
        events: list[tuple[Kind, int]], sent: bool) -> None:
    read = [Event(kind, KEY, "e", us, ref=b"m" if kind == Kind.KEPT else None, epoch="ep0") for kind, us in events]
    for order in (read, read[::-1]):
        _, lost = journal.sort_out(order, lambda idents: set(), 30, "ep0")
        assert [e.entry for e in lost] == (["e"] if sent else [])


@pytest.mark.parametrize(("broker_url", "store_url", "on"), [
    # The store is the broker's own database: they fail together, no journal.
    ("redis://localhost:6379/0", "redis://127.0.0.1:6379/0", False),
    ("redis://:secret@127.0.0.1/3", "redis://127.0.0.1:6379/3", False),
    ("sentinel://a:26379;sentinel://b:26379", "sentinel://b:26379;sentinel://a:26379", False),
    ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2", False),
    # Another database or server than the broker's, or another transport: the journal.
    ("redis://127.0.0.1:6379/13", "redis://127.0.0.1:6379/12", True),
    ("redis://broker:6379/0", "redis://cache:6379/0", True),
    ("redis://127.0.0.1:6379/0", "redis+cluster://127.0.0.1:7000", True),
    ("amqp://guest:guest@localhost:5672//", "redis://127.0.0.1:6379/0", True),
    ("sqs://", "redis://127.0.0.1:6379/0", True),
    (None, "redis://127.0.0.1:6379/0", True),  # (Celery's default broker: RabbitMQ on localhost)
])
def test_the_journal_is_on_unless_the_store_is_the_brokers_own_database(broker_url: str | None, store_url: str,
                                                                         on: bool) -> None:
    from celery import Celery

    from celery_throttle.check.journaling import journal_on

    app = Celery("journal-default", broker=broker_url, set_as_current=False)
    assert journal_on(app, None, store_url) is on
    # (a setting wins either way)
    assert journal_on(app, True, store_url) is True and journal_on(app, False, store_url) is False


def test_an_entry_left_for_good_a_while_ago_is_named_for_the_store_to_take_back() -> None:
    # Given entries whose latest events are of every kind and age
    now, after, keep = 1_000_000_000, journal.TAKE_BACK_AFTER_US, journal.GONE_KEEP_US
    events = [
        Event(Kind.KEPT, KEY, "sent", 1), Event(Kind.GONE, KEY, "sent", now - after),
        Event(Kind.KEPT, KEY, "put-back", 1), Event(Kind.GONE, KEY, "put-back", now - after - 5),
        Event(Kind.KEPT, KEY, "put-back", now - after - 4),  # (back in its line after its release)
        Event(Kind.GONE, KEY, "just-sent", now - after + 1),  # (its release may not be acked yet)
        Event(Kind.GONE, KEY, "long-gone", now - keep),  # (no longer read: dropped)
        Event(Kind.GONE, KEY, "reported", now - after - 9), Event(Kind.LOST, KEY, "reported", now - after - 8),
        Event(Kind.KEPT, KEY, "waits", now - after - 9),
    ]
    # Then only the one sent that long ago, and not put back since, is named
    assert [e.entry for e in left_for_good(events, now, after)] == ["sent"]
