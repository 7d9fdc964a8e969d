"""One pass of the keeper over the journal (:mod:`.keeper`): under a lock in the store, read
every message the journal holds as it begins, keep each entry's latest event, ask the
store which entries it still holds, publish again what stays, send on what the store lost
(each once: a mark in the store first), and ack what was read.

What a pass holds in memory is bounded: kept messages go to a spooled temporary file as
they are read (SPOOL_IN_MEMORY, then disk), and of each message only its delivery tag is
kept. A message that is not one of ours (another content type, a body that is not bytes,
fields out of shape) holds no event: it is acked and dropped, and never stops a pass.
"""

from __future__ import annotations

import logging
import secrets
import tempfile
import threading
import time
from collections.abc import Iterable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from kombu.exceptions import OperationalError
from kombu.messaging import Producer

from ..celery_parts.messages import resend
from ..core import journal
from ..core.errors import StoreError
from ..core.journal import (
    CONTENT_TYPE,
    GONE_BATCH,
    JOURNAL_HEADER,
    Event,
    Kind,
    decode,
    entries_message,
    kept_headers,
    latest,
    left_for_good,
    sort_out,
)
from ..core.keys import target_of
from ..core.spec import BoundCall

if TYPE_CHECKING:
    from ..check.lines import Lines
    from ..check.setup import Setup

__all__ = ["Pass"]

logger = logging.getLogger("celery_throttle")

#: The pass's lock in the store (seconds), renewed every LOCK_S / 3 while the pass reads,
#: decides and acks: two keepers reading one journal at once would each see half of its
#: events. Short, as a keeper SIGKILLed mid-pass holds it until it runs out, and no pass
#: sends on what the store loses meanwhile (no call of a pass waits longer than a few
#: seconds: the broker's retries, a store call's timeout).
LOCK_S = 15
#: Kept messages a pass holds in memory before it spools the rest to a temporary file.
SPOOL_IN_MEMORY = 8 << 20
#: Entries of one line read per call when a pass adopts what the lines hold.
ADOPT_PAGE = 1000
#: How long (seconds) the store remembers that the keeper sent an entry on: a pass that
#: died after sending and before its acks has its messages back within minutes, and the
#: next pass finds the mark and sends nothing twice.
SENT_ON_KEEP = 3600
#: A sent-on note holds PENDING and its pass's id while the pass sends the task, then SENT
#: and when.
PENDING, SENT = "pending ", "sent "


class Pass:
    """One pass over the journal of an app's lines, on the keeper's ``connection``."""

    def __init__(self, setup: Setup, lines: Lines, connection: Any, stopping: threading.Event | None = None) -> None:
        self.setup = setup
        self.store = setup.store
        self.lines = lines
        self.broker = lines.journal.broker
        self.connection = connection
        self.stopping = stopping or threading.Event()
        self._lock: Any = None
        self._renewed = 0.0
        #: Delivery tags of the messages this pass read (a pass that fails leaves those it
        #: did not ack to its keeper: see Keeper.give_back).
        self.unacked: list[Any] = []
        #: How many of them it has acked (the rest are still the broker's to give back).
        self.acked = 0
        #: What this pass's sent-on notes hold until their sends are done (see _note).
        self.pending = f"{PENDING}{secrets.token_hex(8)}"

    def run(self, adopt: bool = False) -> int | None:
        """The pass; returns how many tasks it left waiting in the journal (None: another
        keeper holds the lock)."""
        store = self.store
        self._lock = store.journal_lock(LOCK_S)
        if not self._lock.acquire():
            return None
        self._renewed = time.monotonic()
        try:
            epoch = store.journal_epoch()[0]
            channel = self.connection.default_channel
            producer = Producer(channel)
            strays = self.broker.restore_strays(self.connection)
            if strays:
                logger.info("celery_throttle: %d message(s) of the journal that a pass read and never acked (its "
                            "worker died, or its broker went away) are back in it", strays)
            # (Read before the journal's length: a lost mark urged after this read may
            # not be in what this pass reads, and asks for the next.)
            urges = store.journal_state().get("urges") or "0"
            held = self.broker.length(self.connection)
            if adopt:
                held += self._adopt(producer, epoch)  # (read back in this pass, at the journal's tail)
            tags = self.unacked
            with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY) as spool:
                events: list[Event] = []
                for message in self.broker.take(self.connection, held):
                    tags.append(message.delivery_tag)
                    events.extend(self._events(message, spool))
                    self._renew()
                left, suspects = self._decide(events, spool, producer, epoch)
                self._take_back(events)
            for tag in tags:
                channel.basic_ack(tag)
                self.acked += 1
                self._renew()
            due = time.time() + journal.LOST_AFTER_US / 1e6 if suspects else 0
            store.save_journal_state({"left": left, "at": time.time(), "adopted": 1, "due": due, "seen": urges})
            logger.debug("celery_throttle: the journal's pass read %d message(s) and left %d", len(tags), left)
            return left
        finally:
            try:
                self._lock.release()
            except StoreError:
                logger.debug("celery_throttle: the journal's lock could not be given up (it runs out by itself)")

    def _renew(self) -> None:
        """Keep the lock while the pass goes on (a lock lost to another keeper ends it:
        what it read and did not ack goes back to the journal)."""
        if time.monotonic() - self._renewed > LOCK_S / 3:
            if not self._lock.renew():
                raise StoreError("the journal's lock ran out and another keeper holds it: this pass ends")
            self._renewed = time.monotonic()

    @staticmethod
    def _events(message: Any, spool: Any) -> list[Event]:
        """The events of one message read (its kept message spooled); none for a message
        not of ours."""
        body, headers = message.body, message.headers
        if message.content_type != CONTENT_TYPE or not isinstance(body, bytes) or not isinstance(headers, dict):
            return []
        ref = None
        if headers.get(JOURNAL_HEADER) == Kind.KEPT.value:
            ref = (spool.tell(), len(body))
            spool.write(body)
        return decode(headers, body, ref)

    def _decide(self, events: list[Event], spool: Any, producer: Producer, epoch: str) -> tuple[int, int]:
        """Publish again what stays, send on what was lost; returns (the entries left, those
        of them marked as not known to the store)."""
        again, lost = sort_out(events, self._known, self.store.now_us(), epoch)
        self._say_dropped(events, again, lost, epoch)
        left, suspects, gone = 0, 0, []

        def body(event: Event) -> bytes:
            offset, size = event.ref
            spool.seek(offset)
            data = spool.read(size)
            spool.seek(0, 2)
            return bytes(data)

        marks = []
        for event in again:
            if event.kind == Kind.GONE:
                gone.append((event.key, event.entry, event.us))
            elif event.kind == Kind.LOST:
                marks.append((event.key, event.entry, event.us))
            else:
                self.broker.publish(producer, kept_headers(event.key, event.entry, event.us, event.suspect,
                                                           event.place, event.epoch), body(event))
                left += 1
                suspects += bool(event.suspect)
            self._renew()
        for kind, batch in ((Kind.GONE, gone), (Kind.LOST, marks)):
            for start in range(0, len(batch), GONE_BATCH):
                headers, message = entries_message(kind, batch[start:start + GONE_BATCH])
                self.broker.publish(producer, headers, message)
        sent, now_us = 0, self.store.now_us()
        for event in lost:
            if self._send_on(event, body(event)):
                sent += 1
                # (Its copy ends with it: a pass that dies before its acks gives its events
                # back, and this gone, later than them, says it is sent, even to a store
                # lost again meanwhile, which lost the mark too.)
                headers, message = entries_message(Kind.GONE, [(event.key, event.entry, max(now_us, event.us))])
                self.broker.publish(producer, headers, message)
            self._renew()
        for _ in range(sent):
            self.setup.metrics.store_error("lost-sent-on")
        if sent:
            logger.warning("celery_throttle: the store lost %d task(s) waiting in %d line(s): sent on from the "
                           "journal, as new tasks (each named at INFO)", sent, len({e.key for e in lost}))
        return left, suspects

    @staticmethod
    def _say_dropped(events: list[Event], again: list[Event], lost: list[Event], epoch: str) -> None:
        """Name each waiting task whose copy this pass drops: the store does not know it at
        two looks and still has its epoch (it left its line without a word reaching the
        journal). Rare, and the one verdict that ends a copy with no send: if a task ever
        vanishes, this is where to look."""
        decided = {event.ident for event in again} | {event.ident for event in lost}
        dropped = [event for ident, event in latest(events).items()
                   if event.kind == Kind.KEPT and ident not in decided]
        for event in dropped:
            logger.info("celery_throttle: task %s of the line of %s is not in the store, whose epoch is still its "
                        "own (%s): it left its line without a word reaching the journal; its copy is dropped",
                        event.entry, event.key, epoch)
        if dropped:
            logger.warning("celery_throttle: %d task(s) the journal kept had left their lines without a word: their "
                           "copies are dropped (each named at INFO)", len(dropped))

    def _take_back(self, events: list[Event]) -> int:
        """Take out of their lines the tasks the journal says left them for good (sent to the
        broker) a while ago and the store holds again, waiting or released and not acked:
        the store was taken back (a failover to a replica short of their release, a
        releaser that died between its send and its ack), and its line would send each a
        second time. Returns how many."""
        now_us = self.store.now_us()
        gone = left_for_good(events, now_us, min(journal.TAKE_BACK_AFTER_US, journal.TAKE_BACK_OUT_AFTER_US))
        lined = {event.ident for event in gone if now_us - event.us >= journal.TAKE_BACK_AFTER_US}
        idents = [event.ident for event in gone]
        held: dict[str, tuple[list[str], list[str]]] = {}
        for start in range(0, len(idents), 1000):
            batch = idents[start:start + 1000]
            for ident, there in zip(batch, self.store.in_lines(batch)):
                if there == "out" or (there == "line" and ident in lined):
                    held.setdefault(ident[0], ([], []))[ident not in lined].append(ident[1])
            self._renew()
        taken = 0
        for key, (in_line, out) in held.items():
            target = target_of(self.store.prefix, key)
            if target is None:
                continue
            # (No rates: the call reads none, and takes out only what the journal names.)
            call = BoundCall(target[0], target[1], (), 1, "sliding", key)
            # (An entry out may have been put back in its line since the look: taken out of
            # its line only if its gone is old enough for that, else its copy may follow.)
            reply = self.lines.checker.take_back(call, in_line, out)
            self.lines.handle(call, reply)  # (the index hears of the line as it is now)
            for task in reply.reported:
                if task.kind == "k":
                    taken += 1
                    logger.info("celery_throttle: task %s had left the line of %s for good, and the store held it "
                                "again: taken out", task.id, target)
            self._renew()
        if taken:
            logger.warning("celery_throttle: the store held again %d task(s) that had left their lines for good (sent "
                           "to the broker): a failover to a replica short of their release, or a releaser that died "
                           "before its ack; taken out, not sent twice (each named at INFO)", taken)
        return taken

    def _known(self, idents: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which (key, entry) the store holds: waiting in its line, released and not
        started, or started lately."""
        store, idents = self.store, list(idents)
        known: set[tuple[str, str]] = set()
        for start in range(0, len(idents), 1000):
            batch = idents[start:start + 1000]
            known.update(ident for ident, held in zip(batch, store.known_entries(batch)) if held)
            self._renew()
        return known

    def _send_on(self, event: Event, body: bytes) -> bool:
        """A task the store lost: its message is sent to the broker as a new task (checked
        as any other: it joins its line again, first come first served), once: the store
        notes it first. False: not sent (sent by an earlier pass, or kept as a dead letter:
        it could not be). Raises the broker's connection errors (the pass fails; the next
        sends it)."""
        note = f"{event.key}\n{event.entry}"
        if not self._note(note):
            return False
        target = target_of(self.store.prefix, event.key)
        try:
            resend(self.setup.app, body)
        except (OperationalError, OSError):
            raise  # (the broker is away: not sent, and the note says so to the next pass)
        except Exception as exc:  # noqa: BLE001 - a message that cannot be sent: kept for people
            logger.error("celery_throttle: task %s waited in the line of %s and the store lost it; its copy in the "
                         "journal cannot be sent (%r): kept as a dead letter (throttle parked --dead)", event.entry,
                         target or event.key, exc)
            self.store.bury(event.entry, body)
            return False
        logger.info("celery_throttle: task %s waited in the line of %s and the store lost it: sent on from the "
                    "journal, as a new task", event.entry, target or event.key)
        # (Best effort: the gone event this pass publishes next says it too.)
        with suppress(StoreError):
            self.store.note_sent_on(note, f"{SENT}{int(time.time())}", SENT_ON_KEEP)
        return True

    def _note(self, note: str) -> bool:
        """Note in the store that this pass sends on the task of ``note``; whether it is
        this pass's to send. A note another pass made and never marked sent is taken over:
        that pass failed or died between its note and its send's end (passes run one at a
        time, under the lock), and whether its send went out is not known (its reply lost,
        its process killed): the task is sent again, to run twice rather than never."""
        held = self.store.note_sent_on(note, self.pending, SENT_ON_KEEP, only_if_new=True)
        if held == self.pending:
            return True
        if held.startswith(PENDING):
            self.store.note_sent_on(note, self.pending, SENT_ON_KEEP)
            return True
        return False

    def _adopt(self, producer: Producer, epoch: str) -> int:
        """Keep in the journal what waits in the store's lines now (joined before the
        journal was on, or through a process with it off). Returns how many."""
        store, adopted = self.store, 0
        keys = list(store.indexed())
        for key in keys:
            after: Any = "-inf"
            while not self.stopping.is_set():
                # (The clock before the page: a task released after it is gone at a later
                # time, whichever event the journal gets first; one released before it is
                # not in the page. By place, not rank: the head may leave meanwhile.)
                us = store.now_us()
                page = store.line_page(key, after, ADOPT_PAGE)
                for entry, _, message in page:
                    if message:
                        adopted += 1
                        self.broker.publish(producer, kept_headers(key, entry.decode(errors="surrogateescape"), us,
                                                                   place=adopted, epoch=epoch),
                                            bytes(message), declare=adopted == 1)
                self._renew()
                if len(page) < ADOPT_PAGE:
                    break
                after = f"({page[-1][1]!r}"
        if adopted:
            logger.info("celery_throttle: %d task(s) waiting in the lines are now kept in the journal too", adopted)
        return adopted

