"""Concurrency slots, this process's side: at most K bodies of a scope and key run at once.

A task with ``concurrency=K`` takes a slot in the same check as its rates (window.lua):
the slot is its delivery's (a holder id: its task id, this worker and a nonce of its own,
so that two deliveries of one task id hold two), a lease this process renews while the
body runs (a thread, every third of ``throttle_concurrency_lease``) and gives back when
the body ends, however it ends (:meth:`Slots.release`). A task that finds every slot
taken waits in its key's line with every other task that cannot start; the body that
gives a slot back releases the line's head in the same call, and a released task is
handed its slot with its ticket, so a fresh arrival cannot take it first. A worker that
dies holding slots stops renewing them: their leases run out, and the next call on the
key, or a releaser's look (the key's next look is when its first lease runs out), hands
them on.

Threads: the table of held slots is the process's, shared by a threads or gevent pool's
threads, under a lock held for dict operations only.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import StoreError
from ..core.keys import encode, glob_escape
from ..core.locks import ForkSafeLock
from ..core.protocol import Code
from ..core.spec import BoundCall

if TYPE_CHECKING:
    from .checker import Checker
    from .lines import Lines
    from .setup import Setup

__all__ = ["RENEWALS_PER_LEASE", "WORKER_PID", "Slots", "holder_id", "holder_prefix", "is_nonce", "nonce_of"]

#: A holder's nonce: this many hex digits (64 random bits).
NONCE_CHARS = 16

logger = logging.getLogger("celery_throttle")

#: The worker this process belongs to (its main process's pid): set at worker start, and
#: inherited by its pool processes, so that a slot held by a body whose process was killed
#: is found by the main process (:func:`holder_id`).
WORKER_PID = os.getpid()


def holder_id(task_id: str, nonce: str | None = None) -> str:
    """A delivery of ``task_id`` holding a concurrency slot: its task id, this worker, and
    (given, or random) a nonce of its own: two deliveries of one task id hold two slots."""
    return f"{holder_prefix(task_id)}{nonce or secrets.token_hex(NONCE_CHARS // 2)}"


def nonce_of(holder: str) -> str:
    """The nonce a holder ends with ("" for none)."""
    nonce = holder.rpartition(":")[2]
    return nonce if is_nonce(nonce) else ""


def is_nonce(text: str) -> bool:
    """Whether ``text`` is a holder's nonce as :func:`holder_id` makes one (a header may
    name one: anything else is read as none)."""
    return len(text) == NONCE_CHARS and all(c in "0123456789abcdef" for c in text)


def holder_prefix(task_id: str) -> str:
    """What every holder of ``task_id`` in this worker starts with."""
    return f"{encode(task_id)}@{WORKER_PID}:"

#: A lease is renewed this many times within its length: a renewal may be late by two
#: thirds of a lease (a slow store, a stalled process) before the slot is lost.
RENEWALS_PER_LEASE = 3


@dataclass(frozen=True)
class Held:
    """A slot this process holds: the call its body runs as."""

    call: BoundCall


class Slots:
    """This process's concurrency slots, for one app."""

    def __init__(self, setup: Setup, checker: Checker, lines: Lines) -> None:
        self.setup, self.checker, self.lines = setup, checker, lines
        self._lock = ForkSafeLock()
        self._held: dict[str, Held] = {}
        self._pid = os.getpid()
        self._renewer: threading.Thread | None = None

    def _forked(self) -> None:
        """A child of a fork holds nothing of its parent's (and runs no renewer yet)."""
        if os.getpid() != self._pid:
            self._pid, self._held, self._renewer = os.getpid(), {}, None

    # -- holding and giving back ---------------------------------------------------------
    def took(self, holder: str, call: BoundCall) -> None:
        """A body of ``call`` starts holding a slot as ``holder``: renewed until it ends."""
        self._forked()
        with self._lock:
            self._held[holder] = Held(call)
        self.setup.metrics.running(call.scope, call.key, 1)
        self._start_renewer()

    def holds(self, holder: str) -> bool:
        with self._lock:
            return holder in self._held

    def release(self, holder: str) -> None:
        """Give back ``holder``'s slot (its body ended), releasing the line's head."""
        self._forked()
        with self._lock:
            held = self._held.pop(holder, None)
        if held is None:
            return
        call = self.checker.with_live_concurrency(held.call)
        self.setup.metrics.running(call.scope, call.key, -1)
        reply = self.checker.ended(call, holder)
        if reply.code == Code.LOST:
            self._lost(call.state_key, holder)
        if call.share is not None and (reply.running >= reply.slot_cap or not (reply.running or reply.waiting)) \
                and not any(t.kind == "r" for t in reply.reported):
            # (The slot went back beyond the key's cap, or the key has nothing left to run: the
            # sharer hands it on now, rather than at its next pass.)
            with suppress(StoreError):
                self.setup.store.share_poke(call.scope)
        self.lines.handle(call, reply, here=True)

    def release_killed(self, task: Any, task_id: str, args: Any, kwargs: Any) -> int:
        """Give back the slots held by bodies of ``task_id`` in this worker whose process
        was killed (a hard time limit, a revoke that terminated it, a lost process): the
        worker's main process finds them by their holder's name. Returns how many."""
        call = self.checker.bind(task, args or (), kwargs or {})
        holders = self.setup.store.slot_holders(call.state_key, glob_escape(holder_prefix(task_id)) + "*")
        for holder in holders:
            self.lines.handle(call, self.checker.ended(call, holder))
        return len(holders)

    def _lost(self, state_key: str, holder: str) -> None:
        self.setup.metrics.store_error("slot-lease-lost")
        logger.warning("%s ran past the lease of its concurrency slot (%s): the lease ran out (not renewed "
                       "for %.0fs: a stalled process, or the store unreachable), and another task may have "
                       "run beside it", holder, state_key, self.setup.settings.concurrency_lease)

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
            time.sleep(self.setup.settings.concurrency_lease / RENEWALS_PER_LEASE)
            try:
                self.renew()
            except Exception as exc:  # noqa: BLE001 - never let the thread die: tried again next round
                logger.warning("could not renew concurrency slots: %r", exc)

    def renew(self) -> None:
        """Extend the lease of every slot this process holds (one call per key)."""
        with self._lock:
            by_key: dict[str, tuple[BoundCall, list[str]]] = {}
            for holder, held in self._held.items():
                by_key.setdefault(held.call.state_key, (held.call, []))[1].append(holder)
        for call, holders in by_key.values():
            try:
                reply = self.checker.renew(call, holders)
            except StoreError as exc:
                logger.warning("could not renew the concurrency slots of %s: %s", call.state_key, exc)
                continue
            for lost in reply.reported:
                with self._lock:
                    still = lost.id in self._held
                if still:
                    self._lost(call.state_key, lost.id)
            if reply.tell_index:  # (a lease that ran out may let the line's head go sooner)
                self.lines.note(call.state_key, reply.due_us, reply.now_us)
