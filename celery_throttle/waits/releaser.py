"""The releaser: a thread in every worker that releases the heads of lines when their key
has room.

It claims the keys whose next look is due from the index of keys with a line (index.lua:
a key is claimed by one releaser at a time), runs each line's ``release`` (window.lua)
and sends what it released (:meth:`.lines.Lines.release`), settles each key's next look,
and sleeps until the earliest look in the index, or until woken (a refund, a raised
limit, a resume, a line that begins: BLPOP on a wake list). So a key's head goes within
milliseconds of its room, with no polling of keys that have none.

Between rounds, once a ``throttle_release_interval``, it also gives the index back any line it lost (a line whose writer died between its script and
the index), notes a store that restarted, and reads gauges. An outage of the store is
logged once, summed up while it lasts, and its end logged.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any

from ..check.adaptive import gauge_levels
from ..check.status import known_specs
from ..core.errors import StoreError
from .keeper import Keeper
from .outage import Outage
from .sharer import Sharer

if TYPE_CHECKING:
    from ..check.checker import Checker
    from ..check.lines import Lines
    from ..check.setup import Setup

__all__ = ["CLAIM_LEASE_US", "Outage", "Releaser"]

logger = logging.getLogger("celery_throttle")

#: A releaser looks at keys due within this much of now (µs): its wake-ups are no more
#: precise than a millisecond or two. And a round trip more: the claim's now is one before
#: the release's (a store far away: a claim that took only what was due at its own now
#: found nothing, woken WAKE_TRIPS early, and the release came a settle and a claim late).
LOOKAHEAD_US = 2_000
#: Keys one claim takes at most (a round claims again while it gets this many).
CLAIM_MOST = 32
#: How long (µs) a claimed key stays its releaser's: one that dies meanwhile leaves it to
#: the others after this.
CLAIM_LEASE_US = 10_000_000
#: Round trips to the store a releaser wakes before a line's due time: the BLPOP it waits
#: on ends one after its timeout, the index claim takes one, and the release's script runs
#: half of one after the reads before it. (A store on the same host: a few hundred µs.)
WAKE_TRIPS = 3
#: Chores wait for a gap between looks as long as they took last time, at most this many
#: release intervals (a key due again and again never holds them off for long).
CHORES_PUT_OFF = 3
#: The longest (seconds) one wait for a wake-up blocks: a stopping worker waits this at most
#: for its releaser (and it stays under the store's socket timeout).
WAKE_SLICE = 1.0
#: Seconds between two looks at the store's run id (a restart is logged within this).
STORE_WATCH_EVERY = 10.0
#: Seconds between two searches for lines missing from the index (one worker a round).
INDEX_SWEEP_EVERY = 60.0
#: Seconds between two reads of the gauges.
GAUGE_EVERY = 10.0


class Releaser(threading.Thread):
    """Releases the heads of lines as their keys get room."""

    def __init__(self, setup: Setup, checker: Checker, lines: Lines) -> None:
        super().__init__(name="celery-throttle-releaser", daemon=True)
        self.setup, self.checker, self.lines = setup, checker, lines
        self._stop_event = threading.Event()
        self._chores_at = 0.0
        #: How long the last chores took (seconds).
        self._chores_took = 0.0
        self._gauged_at = float("-inf")
        self._watched_at = time.monotonic()
        self._swept_at = time.monotonic() - INDEX_SWEEP_EVERY * random.random()
        self._outage = Outage("release the lines that have room")
        #: (keys with a line, when: Unix time) at the last watch of the store, to say what
        #: a restart that emptied it lost.
        self._lines_seen: tuple[int, float] | None = None
        #: Woken (BLPOP) since the last round for every part of the index (a resume, a raised
        #: limit: the controls are read again at once), and the parts woken to be looked at
        #: now or told of a look due then (store/index.py).
        self._woken = False
        self._look_now: set[int] = set()
        self._told: dict[int, int] = {}
        #: Per part of the index: the earliest look due in it (µs, the store's clock; -1:
        #: none) as its last claim answered (or a wake-up told), when that was read
        #: (monotonic), and the keys of its last round, settled by its next claim.
        self._first: list[int] = []
        self._read: list[float] = []
        self._unsettled: list[list[tuple[str, int, int, int, int]]] = []
        #: (the store's clock in µs, monotonic seconds) at the last reply: the store's now, told.
        self._clock = (0, 0.0)
        self._chores_outage = Outage("do the releaser's chores (lost index entries, gauges)")
        #: The journal's keeper (started with this thread when the journal is on), and
        #: the sharer of the scopes whose slots are shared.
        self.keeper: Any = None
        self.sharer = Sharer(setup, checker, lines)

    def run(self) -> None:
        try:
            if self.lines.journal.enabled:
                self.keeper = Keeper(self.setup, self.lines)
                self.keeper.start()
        except Exception:  # never let the thread die: lines would wait forever
            logger.exception("celery_throttle: could not start the journal's keeper")
        self.sharer.start()
        sleep = 0.0
        while not self._wait(sleep):
            if self._woken:
                # (Woken by a resume, a raised limit: what it changed is read now, not
                # within CONTROL_REFRESH, so that the lines it woke are looked at under it.)
                self._woken = False
                try:
                    self.checker.refresh_controls()
                except StoreError:
                    pass  # (the round that follows says what is wrong)
            try:
                sleep = self.release_due()
                self._outage.ok()
            except StoreError as exc:
                self._outage.failed(exc)
                sleep = self.setup.settings.release_interval * random.uniform(0.5, 1.0)
            except Exception:  # never let the thread die: lines would wait forever
                logger.exception("releasing lines failed")
                sleep = self.setup.settings.release_interval
            # (The next look is due that long from now, whatever the chores take: with a
            # store far away they are several round trips, and a line due meanwhile would
            # be released that much late. So they wait for a gap as long as they took
            # last time, for CHORES_PUT_OFF intervals at most.)
            wake_at = time.monotonic() + sleep
            since = time.monotonic() - self._chores_at
            interval = self.setup.settings.release_interval
            if since >= interval and (sleep >= self._chores_took or since >= CHORES_PUT_OFF * interval):
                self._chores_at = time.monotonic()
                self.chores()
                self._chores_took = time.monotonic() - self._chores_at
            sleep = max(wake_at - time.monotonic(), 0.0)
        try:
            self.settle_all()
        except Exception:
            logger.debug("could not settle the last round's lines on stopping", exc_info=True)

    def stop(self) -> None:
        self._stop_event.set()
        self.sharer.stop()
        if self.keeper is not None:
            self.keeper.stop()

    def _wait(self, seconds: float) -> bool:
        """Wait for the next round: ``seconds``, or less when woken (BLPOP, in slices of
        WAKE_SLICE so a stop is seen). True once stopped."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0.0005 and not self._stop_event.is_set():
            try:
                woken = self.setup.store.wait_for_wake(min(left, WAKE_SLICE))
                if woken is not None:
                    looks, everything = woken
                    self._woken = self._woken or everything
                    for part, due in looks.items():
                        if due is None:
                            self._look_now.add(part)
                        else:
                            self._told[part] = min(due, self._told.get(part, due))
                    break
            except StoreError:
                self._stop_event.wait(left)  # the round that follows says what is wrong
        return self._stop_event.is_set()

    def release_due(self) -> float:
        """Release the heads of every line due now; returns how long (seconds) to sleep
        before the next look (the earliest due in the index, at most the release
        interval). A round claims from each part of the index (one; on a Redis Cluster,
        several) that is woken to be looked at, due by what this releaser last read of it
        or was told, or not read for a release interval; the claim settles the keys of
        the part's last round first."""
        store = self.setup.store
        parts, interval = store.index_parts, self.setup.settings.release_interval
        if len(self._first) != parts:
            self._first, self._read = [0] * parts, [float("-inf")] * parts
            self._unsettled = [[] for _ in range(parts)]
        look_now, self._look_now = self._look_now, set()
        told, self._told = self._told, {}
        for part, due in told.items():
            # (a look due then, noted by a call: waited for, not claimed before it is due)
            self._first[part] = due if self._first[part] < 0 else min(self._first[part], due)
        lookahead = LOOKAHEAD_US + store.rtt_us
        for part in range(parts):
            if part in look_now or self._part_due(part, lookahead, interval):
                self._release_part(part, lookahead)
        self.lines.ack_overdue()
        first = min((f for f in self._first if f >= 0), default=-1)
        if first < 0:
            return interval
        # (Less WAKE_TRIPS round trips: the script's now came half of one before its reply,
        # the wait's BLPOP ends one after its timeout, and the next look claims the key and
        # reads its controls before its release. Early costs a look more; late, a start.)
        early = WAKE_TRIPS * store.rtt_us / 1e6
        return min(max((first - self._now_us()) / 1e6 - early, 0.0), interval)

    def _now_us(self) -> float:
        """The store's clock now, as told by its last reply and this process's since."""
        told, at = self._clock
        return told + (time.monotonic() - at) * 1e6

    def _part_due(self, part: int, lookahead: int, interval: float) -> bool:
        """Whether ``part`` of the index needs a claim now: its earliest look is due (the
        wait ends WAKE_TRIPS round trips early), or it was last read an interval ago (a
        look another process noted there without waking anyone, or settles of its last
        round still to write)."""
        first = self._first[part]
        if time.monotonic() - self._read[part] >= interval:
            return True
        return 0 <= first <= self._now_us() + lookahead + WAKE_TRIPS * self.setup.store.rtt_us

    def _release_part(self, part: int, lookahead: int) -> None:
        """Claim the keys due in ``part`` of the index (settling those of its last round
        first) and release their heads; their settles wait for the part's next claim."""
        store, lines = self.setup.store, self.lines
        drain = not self.setup.settings.enabled  # (throttling switched off: every line goes)
        while True:
            now_us, first, claimed = store.index_claim(lookahead, CLAIM_MOST, CLAIM_LEASE_US, part,
                                                       self._unsettled[part])
            settled = self._unsettled[part] = []
            for key, token in claimed:
                try:
                    due, at = lines.release(key, drain=drain)
                except StoreError:
                    raise
                except Exception:
                    logger.exception("could not release the line of %s", key)
                    due, at = now_us + CLAIM_LEASE_US, now_us
                # (with when its controls were read: a due time computed under controls older
                # than the key's last wake-up never pushes its look later: index.lua)
                settled.append((key, token, due, at, self.checker.controls.read_at_us))
            # (The part's earliest look: the index's, or one of the keys it has not heard of.)
            dues = [first] if first >= 0 else []
            dues += [due for _, _, due, _, _ in settled if due > 0]
            self._first[part], self._read[part] = min(dues, default=-1), time.monotonic()
            self._clock = (now_us, self._read[part])
            if len(claimed) < CLAIM_MOST:
                break

    def settle_all(self) -> None:
        """Ack what was sent and write the settles of every part's last round (a releaser
        that stops)."""
        self.lines.ack_overdue(everything=True)
        for part, settled in enumerate(self._unsettled):
            if settled:
                self.setup.store.index_settle(settled, part)
                self._unsettled[part] = []

    # -- between rounds -------------------------------------------------------------------
    def chores(self) -> None:
        """What is done once a release interval (put off while a look is due sooner than they
        take, CHORES_PUT_OFF intervals at most): lost index entries, a restarted store,
        gauges."""
        try:
            now = time.monotonic()
            if now - self._swept_at >= INDEX_SWEEP_EVERY:
                self._swept_at = now
                self.index_lost_lines()
            if now - self._watched_at >= STORE_WATCH_EVERY:
                self._watched_at = now
                self._watch_store()
            if self.setup.metrics.enabled and now - self._gauged_at >= GAUGE_EVERY:
                self._gauged_at = now
                self.setup.metrics.parked_waiting(self.lines.total_waiting())
                gauge_levels(self.setup.store, known_specs(self.setup.app, self.checker.rule_for), self.setup.metrics)
            self._chores_outage.ok()
        except StoreError as exc:
            self._chores_outage.failed(exc)
        except Exception:
            logger.exception("celery_throttle: a releaser's chores failed")

    def index_lost_lines(self) -> int:
        """Give the index back every line it does not hold (its writer died between its
        script and the index, or the index was evicted): SCAN, one worker a round. A line
        is found by its counts or by its entries (a store evicting may take either: the
        next call counts a line again from its entries, line.lua)."""
        store = self.setup.store
        missing = store.unindexed_lines(int(INDEX_SWEEP_EVERY * 1000 * 0.8))
        if missing is None:
            return 0  # (another worker swept lately)
        now_us, found = store.now_us(), 0
        for key in missing:
            found += store.index_note(key, now_us, now_us)
        if found:
            logger.warning("celery_throttle: %d line(s) were missing from the index; they are looked at now", found)
            self.lines.wake_releasers()
        return found

    def _watch_store(self) -> None:
        """Say so when the store restarted (its run id changed) while this worker ran:
        whatever it did not keep on disk (lines, counts) may be lost."""
        report = self.setup.store.report(self.keeper is not None)
        before = report.restarted_from
        if before is not None and report.run_id is not None:
            self.setup.metrics.store_error("restart")
            seen = self._lines_seen
            lines = (f" ({seen[0]} key(s) had tasks waiting in their lines {time.time() - seen[1]:.0f}s before)"
                     if seen and seen[0] else "")
            if self.keeper is not None:
                self.keeper.urge()
                lost = "counts it did not keep on disk are lost; the tasks waiting in its lines are sent on from " \
                       "the journal"
            else:
                lost = "tasks waiting in its lines and counts it did not keep on disk are lost"
            logger.error("celery_throttle: the throttle store restarted (run id %s -> %s): %s%s%s", before[:8],
                         report.run_id[:8], lost, lines, "".join(f"; {risk}" for risk in report.risks))
        self._lines_seen = (self.lines.count(), time.time())
