"""Long waits: parked in Redis, released by the workers themselves.

A denied task whose wait is longer than ``throttle_park_after`` is not sent back as an
ETA message (which a worker would hold in memory, and which a Redis broker would deliver
again after ``visibility_timeout``). Its message is stored in Redis by due time; every
worker runs a :class:`Releaser` thread that, about once a second, takes what is due
(atomically, under a lease) and sends it back to the broker with the few seconds left
as countdown. No extra process to run; any number of workers may release.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from .broker_parking import broker_parking
from .errors import StoreError
from .keys import PARKED_TAG_END
from .messages import encode_message, resend

if TYPE_CHECKING:
    from .limiter import Throttle

__all__ = ["Releaser", "park", "parked_task_id"]

logger = logging.getLogger("celery_throttle")
#: How long (seconds) a worker holds parked messages it took, to send them back; if it
#: dies first, they are handed out again after this.
_LEASE_S = 60.0
#: Messages taken per release call.
BATCH = 500
#: Sent messages are acked this many at a time: a release cut short (its worker killed)
#: re-releases at most these, and a refill of thousands of parked tasks due together is
#: not slowed down by a round trip per message (which made many miss their start).
_ACK_EVERY = 16
#: Times a parked message is handed out at most (each time it could not be sent back,
#: or its worker died holding it) before it is a dead letter, kept for the CLI
#: (``celery throttle parked --dead``) instead of coming back forever.
MAX_ATTEMPTS = 5
#: The longest (seconds) one wait for a wake-up blocks: a stopping worker waits this at most
#: for its releaser (and it stays under the store's socket timeout).
WAKE_SLICE = 1.0
#: Seconds between two looks at the store's run id (a restart is logged within this).
STORE_WATCH_EVERY = 10.0
#: Seconds an entry of the index of tasks parked in the broker is kept after it was due
#: (the task has reached its queue by then, or `throttle why` asks the workers).
BROKER_INDEX_KEPT = 60.0
#: Seconds between two reads of the parked count for the Prometheus gauge.
_GAUGE_EVERY = 10.0


def park(ctl: Throttle, sig: Any, due_us: int, tag: str | None = None, *, now_us: int | None = None) -> str:
    """Keep a deferred task's message until ``due_us`` (Redis clock): in RabbitMQ when
    ``ctl`` parks there (:mod:`.broker_parking`; ``now_us``, the Redis clock's now, gives
    the wait), else in Redis. ``tag``: the state tag of its scope and key
    (:func:`.keys.state_tag`) when a pause holds it, so that a resume finds it; its id
    starts with it. Returns its parked id (``""``: in the broker)."""
    broker = broker_parking(ctl)
    if broker is not None and now_us is not None:
        try:
            broker.park(sig, due_us, now_us, held=tag is not None)
            return ""
        except Exception as exc:  # noqa: BLE001 - any broker error: the store keeps it instead
            logger.warning("could not park %s[%s] in the broker, parking it in the store: %r", sig.task,
                           sig.options.get("task_id"), exc)
    parked_id = f"{sig.options.get('task_id')}:{uuid.uuid4().hex[:12]}"
    if tag is not None:
        parked_id = f"{tag}{PARKED_TAG_END}{parked_id}"
    ctl.parking.park(parked_id, due_us, encode_message(ctl.app, sig))
    return parked_id


def parked_task_id(parked_id: str) -> str:
    """The task id in a parked id (``[tag|]task id:suffix``)."""
    return parked_id.rpartition(PARKED_TAG_END)[2].rpartition(":")[0]


class Releaser(threading.Thread):
    """Sends parked messages back to the broker when they are due."""

    def __init__(self, ctl: Throttle) -> None:
        super().__init__(name="celery-throttle-releaser", daemon=True)
        self.ctl = ctl
        self._stop_event = threading.Event()
        self._gauged_at = float("-inf")
        self._watched_at = time.monotonic()
        #: Woken by a resume since the last round.
        self._woken = False
        #: The pauses in force at the last round (None: no round yet): one that is gone
        #: since (ended, resumed, or lost with the store) lets the tasks it held go.
        self._pauses_seen: set[str] | None = None

    def run(self) -> None:
        interval = self.ctl.settings.release_interval
        while not self._wait(interval * random.uniform(0.8, 1.0)):
            try:
                while self.release_once() >= BATCH and not self._stop_event.is_set():
                    pass
            except StoreError as exc:
                logger.warning("could not release parked tasks: %s", exc)
            except Exception:  # never let the thread die: parked tasks would wait forever
                logger.exception("releasing parked tasks failed")
            try:
                self.ctl.slots.sweep()
            except StoreError as exc:
                logger.warning("could not sweep concurrency slots: %s", exc)
            except Exception:
                logger.exception("sweeping concurrency slots failed")
            try:
                self.move_held()
            except StoreError as exc:  # the pauses cannot be read: what they hold stays held
                logger.warning("could not look for tasks held by a pause that is over: %s", exc)
            except Exception as exc:  # noqa: BLE001 - the broker: tried again next round
                logger.warning("could not move tasks held by a pause back to their queue: %r", exc)

    def _wait(self, seconds: float) -> bool:
        """Wait for the next round: ``seconds``, or less when a resume wakes this releaser
        (BLPOP, in slices of WAKE_SLICE so a stop is seen). True once stopped."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not self._stop_event.is_set():
            try:
                if self.ctl.parking.wait_for_wake(min(left, WAKE_SLICE)):
                    self._woken = True
                    break
            except StoreError:
                self._stop_event.wait(left)  # the round that follows says what is wrong
        return self._stop_event.is_set()

    def stop(self) -> None:
        self._stop_event.set()

    def move_held(self) -> None:
        """With parking in the broker: move the tasks a pause held back to their queue
        when a pause is over since the last round, or a resume woke this releaser (and
        once at start: a pause may have ended while no worker ran)."""
        broker = broker_parking(self.ctl)
        if broker is None:
            return
        now_us = self.ctl.store.now_us()
        active = {field for field, end in self.ctl.checker.pauses().items() if end > now_us}
        seen, self._pauses_seen = self._pauses_seen, active
        woken, self._woken = self._woken, False
        if woken or seen is None or not seen <= active:
            broker.move_held()

    def _watch_store(self) -> None:
        """Say so when the store restarted (its run id changed) while this worker ran:
        whatever it did not keep on disk (parked tasks, counts) may be lost."""
        ctl = self.ctl
        report = ctl.store.report(broker_parking(ctl) is not None)
        before, ctl.store_run_id = ctl.store_run_id, report.run_id
        if before is not None and report.run_id is not None and report.run_id != before:
            ctl.metrics.store_error("restart")
            logger.error("celery_throttle: the throttle store restarted (run id %s -> %s): parked tasks and "
                         "counts it did not keep on disk are lost%s", before[:8], report.run_id[:8],
                         "".join(f"; {risk}" for risk in report.risks))

    def release_once(self) -> int:
        """Release what is due within the next interval; returns how many were taken.

        Sent messages are acked every _ACK_EVERY, so a release cut short sends at most that
        many twice. One that cannot be decoded or sent goes back to wait, due again after a
        backoff, until it has been tried MAX_ATTEMPTS times.
        """
        ctl = self.ctl
        interval = ctl.settings.release_interval
        lookahead_us = int(interval * 1.5 * 1e6)
        now_us, items = ctl.parking.release(lookahead_us, BATCH, int(_LEASE_S * 1e6), MAX_ATTEMPTS)
        sent, unacked = 0, []
        for parked_id, due_us, message in items:
            if message is None:
                logger.error("parked task %s was due but its message is gone from the store (evicted, or "
                             "deleted by hand): it cannot run; kept as a dead letter (throttle parked --dead)",
                             parked_task_id(parked_id))
                ctl.metrics.lost()
                continue
            try:
                resend(ctl.app, message, max(due_us - now_us, 0) / 1e6)
            except Exception:  # anything this message does: the others still go
                logger.exception("could not send parked task %s back; it will be tried again", parked_id)
                ctl.parking.retry_later([parked_id], now_us + int(interval * 2 * 1e6))
                continue
            unacked.append(parked_id)
            sent += 1
            if len(unacked) >= _ACK_EVERY:
                ctl.parking.ack(unacked)
                unacked = []
        ctl.parking.ack(unacked)
        if sent:
            logger.info("released %d parked task(s)", sent)
            ctl.metrics.released(sent)
        if time.monotonic() - self._watched_at > STORE_WATCH_EVERY:
            self._watched_at = time.monotonic()
            self._watch_store()
            if broker_parking(ctl) is not None:
                ctl.parking.forget_in_broker(due_before_us=now_us - int(BROKER_INDEX_KEPT * 1e6))
        if ctl.metrics.enabled and time.monotonic() - self._gauged_at > _GAUGE_EVERY:
            self._gauged_at = time.monotonic()
            ctl.metrics.parked_waiting(ctl.parking.parked_count()[0])
        return len(items)
