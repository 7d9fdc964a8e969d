"""The keeper: a thread in every worker that, with the journal on, reads the journal now
and then (one worker at a time), drops what is over, and sends on, each as a new task,
the tasks the store lost: their latest event says they wait, the store no longer knows
them (it restarted empty, it evicted them).

A pass reads every message the journal holds as it begins, keeps each entry's latest
event (:func:`celery_throttle.core.journal.latest`), asks the store which of the entries
it still holds, and publishes again what must stay (:func:`~celery_throttle.core.journal.verdict`)
before it acks what it read: a keeper that dies mid-pass leaves its messages to the
broker, which gives them back, and events read twice say the same. A pass runs when the
journal has doubled since the last one left it (each message is read a bounded number of
times, whatever the depth of the lines), at least every ``SWEEP_EVERY`` while it holds
anything (what a store evicted is found within it), at once when the store restarted,
and when a worker starts and finds no trace of one.

The first pass on a store also adopts what waits in its lines without a copy in the
journal (tasks that joined before the journal was on): each is kept there as it is then.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Iterable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from kombu.messaging import Producer

from ..celery_parts.messages import resend
from ..core.journal import (
    GONE_BATCH,
    LOST_AFTER_US,
    Event,
    Kind,
    decode,
    gone_message,
    kept_headers,
    sort_out,
)
from ..core.keys import line_index_key, window_keys
from .outage import Outage

if TYPE_CHECKING:
    from ..check.limiter import Throttle

__all__ = ["Keeper"]

logger = logging.getLogger("celery_throttle")

#: Seconds between two looks at how much the journal holds (a passive declare).
LOOK_EVERY = 5.0
#: A pass begins when the journal holds GROWTH times what the last pass left in it, plus
#: PASS_MIN messages: so a message is read again a bounded number of times on average,
#: however deep the lines.
GROWTH, PASS_MIN = 2, 1000
#: A pass at least this often (seconds) while the journal holds anything: a task the
#: store evicted is sent on within it.
SWEEP_EVERY = 600.0
#: The pass's lock in the store (seconds), renewed every RENEW_EVERY messages read: two
#: keepers reading one journal at once would each see half of its events.
LOCK_S, RENEW_EVERY = 60, 500
#: Kept messages a pass holds in memory before it spools the rest to a temporary file.
SPOOL_IN_MEMORY = 8 << 20
#: Entries of one line read per call when the first pass adopts what the lines hold.
ADOPT_PAGE = 1000


def keeper_keys(prefix: str) -> tuple[str, str]:
    """The pass's lock, and the hash of what the last pass left (``left``, ``at``,
    ``adopted``), beside the index of keys with a line."""
    return f"{prefix}:{{lines}}:keeper", f"{prefix}:{{lines}}:journal"


class Keeper(threading.Thread):
    """Reads the journal of one app now and then; sends on what the store lost."""

    def __init__(self, ctl: Throttle) -> None:
        super().__init__(name="celery-throttle-keeper", daemon=True)
        self.ctl = ctl
        self._stop_event = threading.Event()
        self._urged = threading.Event()
        #: Until when (monotonic) every look makes a pass: after the store restarted, the
        #: events too young to be taken for lost must be read again once they are not.
        self._urgent_until = 0.0
        self._connection: Any = None
        self._outage = Outage("read the journal of the tasks waiting in the lines")

    def urge(self) -> None:
        """The store restarted: a pass now, and on each look for a while."""
        self._urgent_until = time.monotonic() + LOST_AFTER_US / 1e6 + 2 * LOOK_EVERY
        self._urged.set()

    def stop(self) -> None:
        self._stop_event.set()
        self._urged.set()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.look()
                self._outage.ok()
            except Exception as exc:  # noqa: BLE001 - a broker or store fault: said, and tried again
                self._outage.failed(exc)
                self._close()
            self._urged.wait(LOOK_EVERY)
            self._urged.clear()
        self._close()

    def _close(self) -> None:
        if self._connection is not None:
            with suppress(Exception):  # (a broken connection: nothing left to close)
                self._connection.release()
            self._connection = None

    def pass_now(self) -> int | None:
        """A pass now, due or not (None: another keeper holds the lock)."""
        journal = self.ctl.lines.journal
        if self._connection is None:
            self._connection = journal.broker.connect()
        store = self.ctl.store
        with store.errors():
            adopted = store.client.hget(keeper_keys(store.prefix)[1], "adopted")
        try:
            return self.pass_(journal.broker.length(self._connection), adopt=adopted is None)
        except Exception:
            self._close()  # (what it read and did not ack goes back to the journal)
            raise

    def look(self) -> int | None:
        """A pass if one is due; returns what it left in the journal (None: no pass)."""
        journal = self.ctl.lines.journal
        if not journal.enabled:
            return None
        if self._connection is None:
            self._connection = journal.broker.connect()
        held = journal.broker.length(self._connection)
        store = self.ctl.store
        _, state = keeper_keys(store.prefix)
        with store.errors():
            left, at, adopted = store.client.hmget(state, ["left", "at", "adopted"])
        now = time.time()
        due = (time.monotonic() < self._urgent_until or adopted is None or at is None
               or held >= GROWTH * int(left or 0) + PASS_MIN or (held and now - float(at) >= SWEEP_EVERY))
        return self.pass_(held, adopt=adopted is None) if due else None

    def pass_(self, held: int, adopt: bool = False) -> int | None:
        """Read the ``held`` messages at the journal's head and do what their events say
        (under the store's lock: None if another keeper holds it). Returns what it left."""
        store, broker = self.ctl.store, self.ctl.lines.journal.broker
        lock_key, state = keeper_keys(store.prefix)
        with store.errors():
            lock = store.client.lock(lock_key, timeout=LOCK_S, blocking=False)
            if not lock.acquire(blocking=False):
                return None
        try:
            connection = self._connection
            producer = Producer(connection.default_channel)
            if adopt:
                held += self._adopt(producer)  # (read back in this pass, at the journal's tail)
            with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY) as spool:
                read, events = [], []
                for n, message in enumerate(broker.take(connection, held), 1):
                    read.append(message)
                    ref = None
                    if message.body:
                        ref = (spool.tell(), len(message.body))
                        spool.write(message.body)
                    events.extend(decode(message.headers, message.body, ref))
                    if n % RENEW_EVERY == 0:
                        with store.errors():
                            lock.extend(LOCK_S, replace_ttl=True)
                left = self._decide(events, spool, producer)
            for message in read:
                message.ack()
            with store.errors():
                store.client.hset(state, mapping={"left": left, "at": time.time(), "adopted": 1})
            logger.debug("celery_throttle: the journal's pass read %d message(s) and left %d", len(read), left)
            return left
        finally:
            with suppress(Exception):  # (its lease ran out: another keeper may hold it now)
                lock.release()

    def _decide(self, events: list[Event], spool: Any, producer: Producer) -> int:
        """Publish again what stays, send on what was lost; returns the entries left."""
        again, lost = sort_out(events, self._known, self.ctl.store.now_us())
        broker, left, gone = self.ctl.lines.journal.broker, 0, []

        def body(event: Event) -> bytes:
            offset, size = event.ref
            spool.seek(offset)
            return bytes(spool.read(size))

        for event in again:
            if event.kind == Kind.GONE:
                gone.append((event.key, event.entry, event.us))
            else:
                broker.publish(producer, kept_headers(event.key, event.entry, event.us, event.suspect, event.place),
                               body(event))
                left += 1
        for start in range(0, len(gone), GONE_BATCH):
            headers, message = gone_message(gone[start:start + GONE_BATCH])
            broker.publish(producer, headers, message)
        sent = sum(self._send_on(event, body(event)) for event in lost)
        for _ in range(sent):
            self.ctl.metrics.store_error("lost-sent-on")
        if sent:
            logger.warning("celery_throttle: the store lost %d task(s) waiting in %d line(s): sent on from the "
                           "journal, as new tasks (each named at INFO)", sent, len({e.key for e in lost}))
        return left

    def _known(self, idents: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which (key, entry) the store holds: waiting in its line, released and not
        started, or started lately."""
        store, idents = self.ctl.store, list(idents)
        known: set[tuple[str, str]] = set()
        for start in range(0, len(idents), 1000):
            batch = idents[start:start + 1000]
            with store.errors():
                pipe = store.client.pipeline(transaction=False)
                for key, entry in batch:
                    _, _, line, _, out, _, used = window_keys(key)
                    for holder in (line, out, used):
                        pipe.zscore(holder, entry)
                scores = pipe.execute()
            for i, ident in enumerate(batch):
                if any(score is not None for score in scores[3 * i:3 * i + 3]):
                    known.add(ident)
        return known

    def _send_on(self, event: Event, body: bytes) -> bool:
        """A task the store lost: its message is sent to the broker as a new task (checked
        as any other: it joins its line again, first come first served). False: it could
        not be, and is kept as a dead letter."""
        try:
            resend(self.ctl.app, body)
        except Exception as exc:  # noqa: BLE001 - a message that cannot be sent: kept for people
            logger.error("celery_throttle: task %s waited in the line of %s and the store lost it; its copy in the "
                         "journal cannot be sent (%r): kept as a dead letter (throttle parked --dead)", event.entry,
                         event.key, exc)
            self.ctl.parking.bury(event.entry, body)
            return False
        logger.info("celery_throttle: task %s waited in the line of %s and the store lost it: sent on from the "
                    "journal, as a new task", event.entry, event.key)
        return True

    def _adopt(self, producer: Producer) -> int:
        """Keep in the journal what waits in the store's lines now (joined before the
        journal was on). Returns how many."""
        store, broker = self.ctl.store, self.ctl.lines.journal.broker
        adopted = 0
        with store.errors():
            keys = [k.decode(errors="surrogateescape") if isinstance(k, bytes) else k
                    for k, _ in store.client.zscan_iter(line_index_key(store.prefix), count=1000)]
        for key in keys:
            _, _, line, msgs, _, _, _ = window_keys(key)
            after: Any = "-inf"
            while True:
                with store.errors():
                    # (The clock and the page at one moment: a task released after it is
                    # gone at a later time, whichever event the journal gets first. By
                    # place, not rank: the head may leave while the line is read.)
                    pipe = store.client.pipeline(transaction=True)
                    pipe.time()
                    pipe.zrangebyscore(line, after, "+inf", start=0, num=ADOPT_PAGE, withscores=True)
                    (secs, micros), page = pipe.execute()
                    ids = [entry for entry, _ in page]
                    bodies = store.client.hmget(msgs, ids) if ids else []
                us = int(secs) * 1_000_000 + int(micros)
                for (entry, _), body in zip(page, bodies):
                    if body:
                        adopted += 1
                        broker.publish(producer, kept_headers(key, entry.decode(errors="surrogateescape"), us,
                                                              place=adopted), bytes(body), declare=adopted == 1)
                if len(page) < ADOPT_PAGE:
                    break
                after = f"({page[-1][1]!r}"
        if adopted:
            logger.info("celery_throttle: %d task(s) waiting in the lines are now kept in the journal too", adopted)
        return adopted
