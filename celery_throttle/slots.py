"""Concurrency slots, the worker's side: at most K bodies of a scope and key run at once.

A task with ``concurrency=K`` takes a slot before its rates are checked (slots.lua, by
:class:`.slot_store.SlotStore`): the slot is its task id's, a lease this process renews
while the body runs (a thread, every third of ``throttle_concurrency_lease``) and gives
back when the body ends, however it ends. A task that finds every slot taken waits off
the queue: its message is kept with the key's FIFO, and it is acked. The holder that
gives a slot back hands it to the head of that FIFO in the same script, and sends the
woken task's message to the broker: no polling, no herd, and a fresh arrival cannot take
the slot first. A worker that dies holding slots stops renewing them: the next call on
the key, or a worker's sweep (:meth:`Slots.sweep`, from the releaser thread), reclaims
them once their lease has run out.

A live limit (``set_limit(scope, concurrency=K)``) replaces the declared K wherever a
slot is taken, given back or swept; a raised K hands its new slots to the tasks waiting
at once (:meth:`Slots.apply_limit`). Cleared, the declared K is back; where the code
declares none (a live K gave a rates-only throttle its slots), every task still waiting
is handed a slot (:data:`UNLIMITED`), and a task that waited takes the slot it was handed
whatever the K of now, so that its kept message is not woken again.

Threads: the table of held slots is the process's, shared by a threads or gevent pool's
threads, under a lock held for dict operations only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from .config import Settings
from .keys import target_of
from .messages import resend
from .metrics import Metrics
from .protocol import SlotCode, SlotReply
from .slot_store import SlotStore
from .spec import BoundCall
from .store import RedisStore

__all__ = ["FULL_HINT_S", "RENEWALS_PER_LEASE", "UNLIMITED", "Slots", "in_force"]

logger = logging.getLogger("celery_throttle")

#: A lease is renewed this many times within its length: a renewal may be late by two
#: thirds of a lease (a slow store, a stalled process) before the slot is lost.
RENEWALS_PER_LEASE = 3
#: For this long (seconds) after a key of this process was found full, a task of that key
#: sends its message with its first try for a slot (one round trip, not two, for a task
#: that will wait).
FULL_HINT_S = 1.0
#: For this long (seconds) after a producer found a key with a slot free and nobody
#: waiting, it sends that key's tasks unchecked: a producer of many tasks a second to a key
#: far under its limit checks it at most 1/FREE_HINT_S times a second (the workers' own
#: take counts every start anyway), and a flood is caught within this long.
FREE_HINT_S = 0.1
#: Keys whose full or free hint a process keeps; past this the hints start afresh (a
#: producer of many tenants must not grow without bound).
HINT_KEYS = 10_000
#: How often (seconds, at most) one worker's sweep visits the keys with waiting tasks;
#: a lock in the store makes it one worker per round, whatever the number of workers.
SWEEP_EVERY_S = 5.0
#: The limit slots are taken, given back and swept under where no K is in force (a live
#: K cleared on a throttle that declares none): a slot for every task that waited.
UNLIMITED = 2**31


def in_force(limit: int) -> int:
    """The limit slots.lua is given for a K of ``limit`` (0: none in force)."""
    return limit or UNLIMITED


@dataclass(frozen=True)
class Held:
    """A slot this process holds: its state key, the K its code declares (0: none), its
    scope and key."""

    state_key: str
    declared: int
    scope: str
    key: str | None


class Owner(Protocol):
    """What the slots work with: the app, its settings, store and metrics."""

    @property
    def app(self) -> Any: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def store(self) -> RedisStore: ...

    @property
    def metrics(self) -> Metrics: ...

    def live_concurrency(self, scope: str, key: str | None) -> int | None:
        """The live concurrency limit of ``scope``/``key`` (this process's copy), or None."""


class Slots:
    """This process's concurrency slots, for one app."""

    def __init__(self, ctl: Owner) -> None:
        self.ctl = ctl
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._full_at: dict[str, float] = {}
        self._free_at: dict[str, float] = {}
        self._pid = os.getpid()
        self._renewer: threading.Thread | None = None
        self._store: SlotStore | None = None
        self._swept_at = 0.0

    @property
    def store(self) -> SlotStore:
        store = self._store
        if store is None or store.store is not self.ctl.store:
            store = self._store = SlotStore(self.ctl.store)
        return store

    @property
    def lease_us(self) -> int:
        return int(self.ctl.settings.concurrency_lease * 1_000_000)

    def _forked(self) -> None:
        """A child of a fork holds nothing of its parent's (and runs no renewer yet)."""
        if os.getpid() != self._pid:
            self._pid, self._held, self._renewer = os.getpid(), {}, None

    # -- taking and giving back ---------------------------------------------------------------
    def looks_full(self, call: BoundCall) -> bool:
        """Whether this process found ``call``'s key full a moment ago (FULL_HINT_S)."""
        return time.monotonic() - self._full_at.get(call.state_key, float("-inf")) < FULL_HINT_S

    def take(self, call: BoundCall, holder: str, message: bytes = b"", first_wait_us: int = 0) -> SlotReply:
        """Take a slot of ``call``'s key for ``holder``; with ``message``, queue it if none is
        free. Tasks that a freed slot was handed to on the way are sent."""
        self._forked()
        store = self.store
        reply = store.take(call.state_key, holder, in_force(call.concurrency), self.lease_us, message, first_wait_us)
        if reply.code == SlotCode.TAKEN:
            with self._lock:
                self._held[holder] = Held(call.state_key, call.declared_concurrency, call.scope, call.key)
            self.ctl.metrics.running(call.scope, call.key, 1)
            self._full_at.pop(call.state_key, None)
            self._start_renewer()
        else:
            _note(self._full_at, call.state_key)
            if reply.code == SlotCode.QUEUED:
                store.index(call.state_key, call.declared_concurrency)
        self.wake(reply)
        return reply

    def seen_free(self, call: BoundCall) -> bool:
        """Whether this process found ``call``'s key free a moment ago (FREE_HINT_S)."""
        return time.monotonic() - self._free_at.get(call.state_key, float("-inf")) < FREE_HINT_S

    def enqueue(self, call: BoundCall, task_id: str, message: bytes = b"") -> SlotReply:
        """At publish: ``FREE`` (send the task), else ``FULL`` or, with ``message``,
        ``QUEUED`` (kept with the key's queue: not sent). Tasks that a freed slot was
        handed to on the way are sent."""
        store = self.store
        reply = store.enqueue(call.state_key, task_id, in_force(call.concurrency), self.lease_us, message)
        if reply.code == SlotCode.FREE:
            _note(self._free_at, call.state_key)
            self._full_at.pop(call.state_key, None)
        else:
            self._free_at.pop(call.state_key, None)
            _note(self._full_at, call.state_key)
            if reply.code == SlotCode.QUEUED:
                store.index(call.state_key, call.declared_concurrency)
        self.wake(reply)
        return reply

    def holds(self, holder: str) -> bool:
        with self._lock:
            return holder in self._held

    def release(self, holder: str) -> SlotReply | None:
        """Give back ``holder``'s slot if this process holds it, handing it to the next
        task waiting (sent now). None if it held none."""
        self._forked()
        with self._lock:
            held = self._held.pop(holder, None)
        if held is None:
            return None
        self.ctl.metrics.running(held.scope, held.key, -1)
        limit = in_force(self.ctl.live_concurrency(held.scope, held.key) or held.declared)
        reply = self.store.release(held.state_key, holder, limit, self.lease_us)
        if reply.code == SlotCode.LOST:
            self._lost(held.state_key, holder)
        self.wake(reply)
        return reply

    def release_for(self, call: BoundCall, holder: str) -> None:
        """Give back a slot held by ``holder`` in another process of this worker, one that
        cannot (a pool process killed by a hard time limit, or terminated)."""
        self.wake(self.store.release(call.state_key, holder, in_force(call.concurrency), self.lease_us))

    def wake(self, reply: SlotReply) -> None:
        """Send each task a slot was handed to back to the broker."""
        for task_id, message in reply.woken:
            if message is None:
                logger.error("task %s waited for a concurrency slot, but its message is gone from the store "
                             "(evicted, or deleted by hand): it cannot run", task_id)
                self.ctl.metrics.lost()
                continue
            try:
                resend(self.ctl.app, message)
            except Exception:
                logger.exception("could not send task %s, woken for a concurrency slot; it is woken again "
                                 "when the slot's lease runs out", task_id)

    def _lost(self, state_key: str, holder: str) -> None:
        self.ctl.metrics.store_error("slot-lease-lost")
        logger.warning("task %s ran past the lease of its concurrency slot (%s): the lease ran out (not renewed "
                       "for %.0fs: a stalled process, or the store unreachable), and another task may have "
                       "run beside it", holder, state_key, self.ctl.settings.concurrency_lease)

    # -- renewing ---------------------------------------------------------------------------
    def _start_renewer(self) -> None:
        if self._renewer is not None and self._renewer.is_alive():
            return
        with self._lock:
            if self._renewer is None or not self._renewer.is_alive():
                self._renewer = threading.Thread(target=self._renew_forever, name="celery-throttle-slots",
                                                 daemon=True)
                self._renewer.start()

    def _renew_forever(self) -> None:
        while True:
            time.sleep(self.ctl.settings.concurrency_lease / RENEWALS_PER_LEASE)
            try:
                self.renew()
            except Exception as exc:  # noqa: BLE001 - never let the thread die: tried again next round
                logger.warning("could not renew concurrency slots: %r", exc)

    def renew(self) -> None:
        """Extend the lease of every slot this process holds."""
        with self._lock:
            by_key: dict[str, list[str]] = {}
            for holder, held in self._held.items():
                by_key.setdefault(held.state_key, []).append(holder)
        for state_key, holder in self.store.renew(by_key, self.lease_us):
            self._lost(state_key, holder)

    # -- the sweep --------------------------------------------------------------------------
    def sweep(self) -> int:
        """Reclaim leases that ran out on keys with waiting tasks (their worker died), and
        wake the tasks the freed slots go to; one worker per SWEEP_EVERY_S. Returns how
        many were woken."""
        if time.monotonic() - self._swept_at < SWEEP_EVERY_S:
            return 0
        self._swept_at = time.monotonic()
        store = self.store
        if not store.lock_sweep(int(SWEEP_EVERY_S * 1000 * 0.8)):
            return 0
        return self._sweep(store.indexed())

    def apply_limit(self, scope: str, key: str | None) -> int:
        """A live concurrency limit of ``scope`` (or its ``key``) was set or cleared: hand
        the slots a higher limit frees to the tasks waiting on its keys, now. Returns how
        many were woken (sent from this process)."""
        prefix = self.ctl.settings.key_prefix
        return self._sweep({state_key: limit for state_key, limit in self.store.indexed().items()
                            if (target := target_of(prefix, state_key)) is not None and target[0] == scope
                            and (key is None or target[1] == key)})

    def _sweep(self, indexed: dict[str, int]) -> int:
        """Reclaim, and hand free slots over on, each of ``indexed`` (state key to the K the
        code declares for it; a live limit wins)."""
        store, prefix, woken = self.store, self.ctl.settings.key_prefix, 0
        for state_key, declared in indexed.items():
            target = target_of(prefix, state_key)
            limit = in_force((target and self.ctl.live_concurrency(*target)) or declared)
            reply = store.sweep(state_key, limit, self.lease_us)
            self.wake(reply)
            woken += len(reply.woken)
            if reply.waiting == 0:
                store.unindex(state_key)
                # (A task queued between the sweep and the unindex: index it again.)
                if store.status(state_key)[1]:
                    store.index(state_key, declared)
        return woken


def _note(hints: dict[str, float], state_key: str) -> None:
    """Note now as the time of ``state_key``'s hint (HINT_KEYS at most)."""
    if len(hints) >= HINT_KEYS and state_key not in hints:
        hints.clear()
    hints[state_key] = time.monotonic()
