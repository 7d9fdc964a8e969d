"""The keeper: a thread in every worker that, with the journal on, reads the journal now
and then (one worker at a time), drops what is over, and sends on, each as a new task,
the tasks the store lost: their latest event says they wait, and the store no longer
holds them and has lost their epoch (it restarted empty), or reported their messages gone.

A pass (:mod:`.journal_pass`) reads every message the journal holds as it begins, keeps each
entry's latest event, asks the store which of the entries it still holds, and publishes
again what must stay before it acks what it read: a keeper that dies mid-pass leaves its
messages to the broker, which gives them back, and events read twice say the same. A pass
runs when the journal has doubled since the last one left it (each message is read a
bounded number of times, whatever the depth of the lines), when one marked tasks the
store did not know (a second look, ``LOST_AFTER`` later), at least every ``SWEEP_EVERY``
while it holds anything, at once when the store restarted or a releaser reported tasks
whose messages the store lost (in any worker: a count of urges in the store), and when a
worker starts and finds no trace of one.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from ..core import journal
from .journal_pass import Pass
from .outage import Outage

if TYPE_CHECKING:
    from ..check.lines import Lines
    from ..check.setup import Setup

__all__ = ["Keeper"]

logger = logging.getLogger("celery_throttle")

#: Seconds between two looks at how much the journal holds (a passive declare).
LOOK_EVERY = 5.0
#: A pass begins when the journal holds GROWTH times what the last pass left in it, plus
#: PASS_MIN messages: so a message is read again a bounded number of times on average,
#: however deep the lines.
GROWTH, PASS_MIN = 2, 1000
#: A pass at least this often (seconds) while the journal holds anything.
SWEEP_EVERY = 600.0
#: How long (seconds) a stopping worker waits for a pass under way.
STOP_WAIT = 5.0


class Keeper(threading.Thread):
    """Reads the journal of one app now and then; sends on what the store lost."""

    def __init__(self, setup: Setup, lines: Lines) -> None:
        super().__init__(name="celery-throttle-keeper", daemon=True)
        self.setup, self.lines = setup, lines
        self._stop_event = threading.Event()
        self._urged = threading.Event()
        #: Until when (monotonic) every look makes a pass: after the store restarted, the
        #: events too young to be judged must be read again once they are not.
        self._urgent_until = 0.0
        self._connection: Any = None
        self._outage = Outage("read the journal of the tasks waiting in the lines")
        #: Delivery tags of journal messages a pass read and could not ack nor give back
        #: (its broker connection broke: see give_back).
        self._orphans: list[Any] = []
        #: Whether this keeper's last pass failed (a store reply lost, the broker gone) and
        #: none has ended since: each look makes one until one does (see look).
        self._failed = False

    def urge(self) -> None:
        """The store restarted: a pass now, and on each look for a while."""
        self._urgent_until = time.monotonic() + journal.LOST_AFTER_US / 1e6 + 2 * LOOK_EVERY
        self._urged.set()

    def stop(self) -> None:
        """Stop after the pass under way (waits for it, STOP_WAIT at most)."""
        self._stop_event.set()
        self._urged.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(STOP_WAIT)

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

    def _connected(self) -> Any:
        if self._connection is None:
            self._connection = self.lines.journal.broker.connect()
        return self._connection

    def pass_now(self) -> int | None:
        """A pass now, due or not (None: another keeper holds the lock)."""
        state = self._state()
        journal_pass = Pass(self.setup, self.lines, self._connected(), self._stop_event)
        try:
            left = journal_pass.run(adopt=state.get("adopted") is None)
        except Exception:
            self._failed = True
            self._orphans.extend(journal_pass.unacked[journal_pass.acked:])
            self._close()  # (what it read and did not ack goes back to the journal)
            raise
        if left is not None:
            self._failed = False
        return left

    def give_back(self) -> int:
        """Put back in the journal what a failed pass read and did not ack. RabbitMQ does it
        itself when the connection closes. A Redis broker does it only for a connection
        still open; one that broke (the broker restarted) leaves the messages aside until
        its visibility timeout (an hour by default), and the copies of the waiting tasks
        with them: a store lost meanwhile would lose those tasks. Returns how many."""
        if not self._orphans:
            return 0
        qos = getattr(self._connected().default_channel, "qos", None)
        restore = getattr(qos, "restore_by_tag", None)
        orphans, self._orphans = self._orphans, []
        if restore is not None:
            for n, tag in enumerate(orphans):
                try:
                    restore(tag)
                except Exception:
                    self._orphans = orphans[n:]
                    raise
            logger.info("celery_throttle: %d message(s) of the journal that a pass read when the broker went "
                        "away are back in it", len(orphans))
        return len(orphans)

    def look(self) -> int | None:
        """A pass if one is due; returns what it left in the journal (None: no pass)."""
        journal = self.lines.journal
        if not journal.enabled:
            return None
        self.give_back()
        held = journal.broker.length(self._connected())
        state = self._state()
        now = time.time()
        left, at, due = int(state.get("left") or 0), state.get("at"), float(state.get("due") or 0)
        # (A pass of this keeper that failed read messages that go back to the journal
        # unjudged: by its broker as the connection closes, by give_back, or by the next
        # pass's restore_strays. Another keeper's pass that began before they were back
        # does not read them, and the state it leaves may say no pass is due for 10
        # minutes: the suspects among them would wait that long to be sent on. A
        # campaign under load lost 87 of 600 to its deadline so.)
        due_now = (self._failed or time.monotonic() < self._urgent_until or state.get("adopted") is None or at is None
                   or held >= GROWTH * left + PASS_MIN or (held and now - float(at) >= SWEEP_EVERY)
                   or (due and now >= due) or int(state.get("urges") or 0) > int(state.get("seen") or 0))
        return self.pass_now() if due_now else None

    def _state(self) -> dict[str, str]:
        """The last pass's state (``left``, ``at``, ``due``, ``adopted``) as the store holds it."""
        return self.setup.store.journal_state()
