"""The sharer: a thread in every worker that, for each scope whose slots are shared
(``@throttle(concurrency=K, key=..., share=...)``), moves its keys' caps to their fair share
(core/share.py) every SHARE_EVERY seconds, one worker at a time (a lock in the store per
scope; the others stand by and take over within the lock's lease if it stops).

A pass reads each key of the scope (its cap, the slots it holds, the tasks waiting),
computes the caps, and writes them lowers first: a cap lowered takes effect at once, but
bodies already running under the old one run on, so a key can hold the larger of its new
cap and what it held after the write. The raises then share what is left of K by that
bound, the keys owed most first, and the lines of the keys raised are looked at now (the
releaser sends their heads). So the scope never holds more than K slots, whatever the
order in which bodies end, and a cap given back is taken up within one pass.

Keys join the share when a task of theirs waits with no cap (:mod:`..check.lines`, on the
reply of the call that put it in line), and leave it after LEAVE_AFTER idle. A body that
ends and gives back a slot beyond its key's cap, and a key that joins, wake the sharer (a
list in the store it waits on), so that the slot goes to the key owed it at once rather
than at the next pass.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from ..check.status import known_specs
from ..core.share import Keeping, KeyUse, plan, raises
from ..store.sharing import CAP_KEEP_MS
from .outage import Outage

if TYPE_CHECKING:
    from ..check.checker import Checker
    from ..check.lines import Lines
    from ..check.setup import Setup

__all__ = ["LEAVE_AFTER", "PASS_DUTY", "SHARE_EVERY", "Sharer"]

logger = logging.getLogger("celery_throttle")

#: Seconds between two passes over a scope while nothing wakes the sharer: how soon a key
#: with work takes the slots of a key that has none left (a pass is four round trips to
#: the store, the keys of the scope read and written in pipelines).
SHARE_EVERY = 0.1
#: The most of a core the sharer spends in passes: after a pass that took T seconds of its
#: thread's CPU it waits T x (1/PASS_DUTY - 1) before the next, woken or not. A pass reads
#: three fields of each key in the share (some 25 µs a key in redis-py, 0.5 µs of the
#: store's CPU): 1 ms for 30 keys, a third of a second for 10 000, which would otherwise
#: take a core of the worker that leads (its consumer's) and share the slots more often
#: than they can change. CPU, not the pass's wall time: its round trips to the store cost
#: the worker nothing, and counted (a far store, a busy one) they kept the sharer deaf to
#: a freed slot's wake-up for 9 times as long after each pass.
PASS_DUTY = 0.1
#: The lock of a scope's sharer (seconds): a worker that stops sharing leaves its scopes
#: to another after this (their caps stay as they were meanwhile: never beyond K).
LOCK_S = 5.0
#: Seconds between two tries of a worker that stands by to take a scope's lock.
STANDBY_EVERY = 1.0
#: A key with nothing held nor waiting this long (seconds) leaves its scope's share.
LEAVE_AFTER = 60.0
#: Seconds between two looks at which scopes of the app are shared (its tasks and rules).
SCOPES_EVERY = 5.0


class Sharer(threading.Thread):
    """Moves the caps of the shared scopes of one app, where this worker holds the lock."""

    def __init__(self, setup: Setup, checker: Checker, lines: Lines) -> None:
        super().__init__(name="celery-throttle-sharer", daemon=True)
        self.setup, self.checker, self.lines = setup, checker, lines
        self._stop_event = threading.Event()
        #: scope -> (its lock, when it was last extended: monotonic)
        self._locks: dict[str, tuple[Any, float]] = {}
        self._tried: dict[str, float] = {}
        #: scope -> key -> credit (core/share.py): what each was due less what it held.
        self._credit: dict[str, dict[str, float]] = {}
        #: which idle keys keep a slot, and since when each has been idle (monotonic).
        self._keeping = Keeping()
        #: scope -> the keys in its share at this worker's last pass (see :meth:`_members`).
        self._known: dict[str, dict[str, Any]] = {}
        #: key -> when (monotonic) its cap was last written (written again before it runs out).
        self._written: dict[str, float] = {}
        self._outage = Outage("share the slots of the shared scopes")
        self._declared: dict[str, int] = {}
        self._declared_at = float("-inf")

    def stop(self) -> None:
        self._stop_event.set()
        for lock, _ in list(self._locks.values()):
            with suppress(Exception):  # (its lease ran out, or the store is away: it runs out by itself)
                lock.release()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                began = time.thread_time()
                for scope, total in self.scopes().items():
                    if self._lead(scope):
                        self.share(scope, total)
                self._outage.ok()
                self._stop_event.wait((time.thread_time() - began) * (1 / PASS_DUTY - 1))
                if self._locks:
                    # (woken at once by a slot given back beyond a cap, or a key that joins)
                    self.setup.store.share_wait(list(self._locks), SHARE_EVERY)
                    continue
            except Exception as exc:  # noqa: BLE001 - never let the thread die: tried again next round
                self._outage.failed(exc)
            self._stop_event.wait(SHARE_EVERY if self._declared else SCOPES_EVERY)

    def scopes(self) -> dict[str, int]:
        """Each shared scope of the app and its K (the live one if set, else the least declared)."""
        if time.monotonic() - self._declared_at >= SCOPES_EVERY:
            declared: dict[str, int] = {}
            for scope, spec in known_specs(self.setup.app, self.checker.rule_for):
                if spec.share is not None and spec.concurrency:
                    declared[scope] = min(declared.get(scope, spec.concurrency), spec.concurrency)
            self._declared, self._declared_at = declared, time.monotonic()
        found = dict(self._declared)
        for scope in found:
            live = self.checker.controls.concurrency_for(self.setup.store, scope, None)
            if live is not None:
                found[scope] = live
        return found

    def _lead(self, scope: str) -> bool:
        """Whether this worker shares ``scope`` now: it holds the lock (extended a third of
        the way through its lease), or took it."""
        now = time.monotonic()
        held = self._locks.get(scope)
        if held is not None:
            lock, extended = held
            if now - extended < LOCK_S / 3:
                return True
            if lock.renew():
                self._locks[scope] = (lock, now)
                return True
            self._lost(scope)  # (another worker shares it now)
        if now - self._tried.get(scope, float("-inf")) < STANDBY_EVERY:
            return False
        self._tried[scope] = now
        lock = self.setup.store.share_lock(scope, LOCK_S)
        if not lock.acquire():
            return False
        self._locks[scope] = (lock, now)
        return True

    def _renew(self, scope: str) -> bool:
        """Whether this worker still shares ``scope``, its lease renewed (LOCK_S from now)
        just before it writes caps. A pass that stalled past its lease (a pause, a slow
        link) and found the lock another's writes nothing: its read is older than the
        other's writes, and a cap written from it, even a lower one, could undo theirs and
        let the scope run more than K."""
        held = self._locks.get(scope)
        if held is None:
            return False
        if not held[0].renew():  # (another took it; a store away raises on, as any pass's fault)
            self._lost(scope)
            return False
        self._locks[scope] = (held[0], time.monotonic())
        return True

    def _lost(self, scope: str) -> None:
        """Another worker shares ``scope`` now: what this one knew of it is forgotten."""
        del self._locks[scope]
        self._credit.pop(scope, None)
        self._known.pop(scope, None)

    def share(self, scope: str, total: int) -> tuple[dict[str, int], list[str]]:
        """One pass over ``scope`` of ``total`` slots: returns the caps written, and the keys
        that left the share."""
        store = self.setup.store
        members = self._members(scope)
        if not members:
            return {}, []
        keys = list(members)
        now = time.monotonic()
        uses = {}
        for k, (cap, held, waiting) in zip(keys, store.share_read(keys)):
            kept = self._keeping.kept(k, now, held, waiting)
            uses[k] = KeyUse(members[k].weight, members[k].most, cap, held, waiting, kept)
        credit = self._credit.setdefault(scope, {})
        caps, lowers = plan(total, uses, credit)
        if lowers and not self._renew(scope):
            return {}, []
        # Lowers first: from then on a key holds the larger of its cap and what it held.
        bound = {k: max(use.held, use.cap) for k, use in uses.items()}
        for (k, cap), (held, _) in zip(lowers, store.share_write(lowers)):
            bound[k] = max(held, cap)
        raised = raises(total, caps, uses, bound, credit)
        stale = [(k, uses[k].cap) for k in keys if caps[k] == uses[k].cap and uses[k].cap
                 and now - self._written.get(k, float("-inf")) > CAP_KEEP_MS / 2000]
        if (raised or stale) and not lowers and not self._renew(scope):  # (renewed once a pass)
            return {}, []
        store.share_write(raised + stale)
        for k, _ in [*lowers, *raised, *stale]:
            self._written[k] = now
        woken = [k for k, _ in raised if uses[k].waiting]
        if woken:
            # Each is due now, held by the index or not: the note of the call that put its
            # task in its line (its look: never, with no cap) may not have landed yet, and a
            # wake-up finds only a key the index holds; noted now, the older note changes
            # nothing when it lands. (Before, a one-off tenant's task waited for good.)
            now_us = store.now_us()
            noted = [k for k in woken if store.index_note(k, now_us, now_us)]
            # (their parts of the index only: nothing of the controls changed)
            for part in sorted({store.index_part(k) for k in noted}):
                store.wake_releasers(part)
        return {**dict(lowers), **dict(raised)}, self._leave(scope, members, uses, now)

    def _members(self, scope: str) -> dict[str, Any]:
        """The keys in ``scope``'s share: the registry's, and any this worker saw at its last
        pass that has not left since, written back. Only the sharer takes a key out (after
        LEAVE_AFTER idle); one missing was evicted, and a key that holds slots under a cap
        the sharer does not see would not count against K when it raises the others."""
        members = self.setup.store.share_members(scope)
        known = self._known.setdefault(scope, {})
        lost = {k: m for k, m in known.items() if k not in members}
        if lost:
            logger.warning("celery_throttle: %d key(s) of the shared scope %r had gone from its registry "
                           "(evicted?); written back", len(lost), scope)
            for k, m in lost.items():
                self.setup.store.share_join(scope, k, m.weight, m.most)
            members.update(lost)
        known.clear()
        known.update(members)
        return members

    def _leave(self, scope: str, members: Any, uses: dict[str, KeyUse], now: float) -> list[str]:
        """The keys idle LEAVE_AFTER leave the share."""
        idle = {}
        for k, use in uses.items():
            if not (use.held or use.waiting) and self._keeping.idle_for(k, now) >= LEAVE_AFTER:
                idle[k] = members[k]
        left = self.setup.store.share_leave(scope, idle)
        for k in left:
            self._known.get(scope, {}).pop(k, None)
            self._keeping.forget(k)
            self._written.pop(k, None)
        return left
