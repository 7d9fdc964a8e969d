"""What this process saw, for the record that ``throttle simulate`` replays
(``throttle_record``, :mod:`..store.recording`): each task's arrival (its scope, key, cost,
priority, and the rates and K in force), its start and its body's end.

Events are buffered and written by a thread of this process every ``FLUSH_EVERY`` seconds,
all in one round trip: a check pays no round trip for the record. Times are the Redis
clock's (µs): an arrival's and a start's from the reply that decided them, a body's end from
this process's clock set to the last reply's. The record is a sample, not a ledger: what a
process had not written when it died is not in it, nor what it could not write (the store
away: the oldest beyond ``MOST_BUFFERED`` go first, said once).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from contextlib import suppress
from typing import Any

from ..core.errors import StoreError
from ..core.locks import ForkSafeLock
from ..core.spec import BoundCall

__all__ = ["FLUSH_EVERY", "MOST_BUFFERED", "Recorder"]

logger = logging.getLogger("celery_throttle")

#: Seconds between two writes of a process's events.
FLUSH_EVERY = 0.5
#: Events a process keeps while the store is away, at most (the oldest go first).
MOST_BUFFERED = 10_000


class Recorder:
    """This process's events for the record (a no-op while ``throttle_record`` is 0)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        self._lock = ForkSafeLock()
        self._events: list[str] = []
        self._writer_pid: int | None = None
        #: The Redis clock less this process's (µs), as of the last reply seen.
        self._offset_us = 0
        self._dropped = False

    @property
    def enabled(self) -> bool:
        return bool(self._owner.settings.record)

    def arrived(self, name: str, call: BoundCall, task_id: str, now_us: int, urgency: int) -> None:
        """Task ``task_id`` (of task ``name``) of ``call`` came to its throttle's first check at ``now_us``."""
        cost: Any = list(call.cost) if isinstance(call.cost, tuple) else call.cost
        now_us = now_us or self._now_us()  # (0: admitted from a lease, no round trip)
        event = {"k": "a", "id": task_id, "task": name, "t": now_us, "s": call.scope, "key": call.key, "c": cost,
                 "u": urgency, "r": ",".join(map(str, call.rates)), "a": call.algorithm, "n": call.concurrency}
        if call.share is not None:
            event["w"], event["m"] = call.share
        self._note(now_us, event)

    def started(self, task_id: str, at_us: int) -> None:
        self._note(at_us, {"k": "s", "id": task_id, "t": at_us or self._now_us()})

    def ended(self, task_id: str) -> None:
        self._note(0, {"k": "e", "id": task_id, "t": self._now_us()})

    def _now_us(self) -> int:
        return int(time.time() * 1e6) + self._offset_us

    def _note(self, clock_us: int, event: dict[str, Any]) -> None:
        """Buffer ``event``. Never raises: the record is a sample, and a task it fails to
        note is counted and runs all the same (it is called between a start and its slot)."""
        try:
            if clock_us and event["t"] == clock_us:
                self._offset_us = clock_us - int(time.time() * 1e6)
            text = json.dumps(event, separators=(",", ":"), default=str)
            start = False
            with self._lock:
                if self._writer_pid != os.getpid():
                    # (A prefork child holds its parent's buffer, written by the parent.)
                    self._events, self._writer_pid, start = [], os.getpid(), True
                self._events.append(text)
                if len(self._events) > MOST_BUFFERED:
                    del self._events[: len(self._events) - MOST_BUFFERED]
                    if not self._dropped:
                        self._dropped = True
                        logger.warning("celery_throttle: the record's events could not be written for a while: "
                                       "the oldest are dropped (throttle simulate will not see them)")
            if start:
                self._start_writer()
        except Exception:  # (see above)
            logger.debug("could not note an event for the record", exc_info=True)

    def _start_writer(self) -> None:
        """A thread that writes the events on its interval (one per process: a prefork
        child does not inherit its parent's)."""

        def loop() -> None:
            while True:
                time.sleep(FLUSH_EVERY)
                try:
                    self.flush()
                except Exception:  # never let the record end the thread
                    logger.exception("could not write the throttle's record")

        threading.Thread(target=loop, name="celery-throttle-record", daemon=True).start()
        # (A producer that sends and exits: what it saw is written as it goes.)
        atexit.register(self._flush_quietly)

    def _flush_quietly(self) -> None:
        with suppress(Exception):  # (at exit: nothing left to tell it to)
            self.flush()

    def flush(self) -> None:
        """Write the events buffered (kept for the next try if the store is away)."""
        with self._lock:
            events, self._events = self._events, []
        if not events:
            return
        try:
            self._owner.store.record(events, self._owner.settings.record)
        except StoreError:
            with self._lock:
                self._events[:0] = events[-MOST_BUFFERED:]
