"""What people on call set at run time, kept in Redis and obeyed by every worker:
pauses and live limits.

One hash per app, ``<prefix>:control``. A field per paused scope (``pause:<scope>``) or
key (``pause:<scope>:<key>``, both encoded as in state keys) holds the end of the pause
in µs of the Redis clock (``FOREVER_US``: until resumed); a field per live limit
(``limit:<scope>`` or ``limit:<scope>:<key>``) holds its rates (``"10/s,5000/h"``), and
one per live concurrency limit (``slots:<scope>`` or ``slots:<scope>:<key>``) its K. A
live limit takes the place of the declared rates of its windows only (a live ``2/s`` on
``10/s, 5000/h``: ``2/s, 5000/h``, :func:`merged_rates`), unless a field
``replace:<scope>[:<key>]`` beside it says it replaces them all. Each
process reads the whole hash at most every ``CONTROL_REFRESH`` seconds: a control set
anywhere holds on every worker within that time, and the process that sets it obeys it
at once.

The hash can be large (a ``Backoff`` per tenant pauses one field per key: 50 000 of them
are about 5 MB), so it is not read whole every time. Every write adds one to its field
``~stamp`` in the same transaction, and a process first reads the stamp alone: the hash
only when the stamp moved, or when ``FULL_READ_EVERY`` has passed (a field written by
hand, without the stamp, is obeyed within that time; a hash no write ever stamped, none
at all or one whose stamp was evicted, comes whole with the stamp's read). The process that
reads pauses that are over deletes them (at most ``PRUNE_BATCH`` a read, each only if
still over), so the hash holds the pauses in force and not every one ever set.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ..core.errors import StoreError
from ..core.locks import ForkSafeLock
from ..core.rates import Rate
from ..core.timing import CONTROL_REFRESH, RTT_COUNTS_FROM_US, STORE_TIMEOUT
from .control_fields import (
    REPLACE_ALL,
    ControlSet,
    limit_field,
    mode_field,
    parse_controls,
    replace_field,
    slots_field,
)

__all__ = ["CONTROL_REFRESH", "FULL_READ_EVERY", "PRUNE_BATCH", "Controls"]

logger = logging.getLogger("celery_throttle")

#: A read of the controls under way for longer than this (seconds: the store's timeout,
#: and some) is taken for lost, and another thread reads.
READ_GIVEN_UP = STORE_TIMEOUT + 1.0
#: A stamped hash is read whole at least this often (seconds) even when its stamp has not
#: moved: a field written by hand (redis-cli HSET, without HINCRBY ~stamp 1) takes effect
#: within this time. A minute's worth of refreshes: at 50 000 pauses the reads cost a
#: process 120 times less than a read every refresh.
FULL_READ_EVERY = 60.0
#: Pauses that are over deleted per read, at most: one script call's work stays small.
PRUNE_BATCH = 500


class Controls:
    """This process's copy of the controls, read again every CONTROL_REFRESH seconds."""

    def __init__(self) -> None:
        self._set = ControlSet({}, {}, {})
        self._read_at = float("-inf")
        #: The stamp of the hash this copy was read from (None: unstamped or not read),
        #: and when it was last read whole (monotonic).
        self._stamp: str | None = None
        self._whole_at = float("-inf")
        self._lock = ForkSafeLock()
        #: (pid, since when) of the thread reading the controls, if one is.
        self._reader: tuple[int, float] | None = None
        #: The Redis clock when this copy was last read (µs; 0: never): a due time a call
        #: computes under this copy is news no newer than that (see :meth:`as_of`).
        self.read_at_us = 0

    def paused_until(self, store: Any, scope: str, key: str | None) -> int:
        """The end of the pause (µs, Redis clock) covering ``scope``/``key``, or 0."""
        self._maybe_refresh(store)
        return self._set.paused_until(scope, key)

    def pauses(self, store: Any) -> dict[str, int]:
        """Every pause: field to end (µs, Redis clock)."""
        self._maybe_refresh(store)
        return dict(self._set.pauses)

    def rates_for(self, store: Any, scope: str, key: str | None, declared: tuple[Rate, ...]) -> tuple[Rate, ...]:
        """The rates in force for a call that declares ``declared`` (see :meth:`ControlSet.rates_of`)."""
        self._maybe_refresh(store)
        return self._set.rates_of(scope, key, declared)

    def mode_for(self, store: Any, scope: str, key: str | None) -> str | None:
        """The live mode of ``scope``/``key`` (see :meth:`ControlSet.mode_of`), or None."""
        self._maybe_refresh(store)
        return self._set.mode_of(scope, key)

    def concurrency_for(self, store: Any, scope: str, key: str | None) -> int | None:
        """The live concurrency limit of ``scope``/``key`` (the key's own first), or None."""
        self._maybe_refresh(store)
        return self._set.concurrency_of(scope, key)


    def refresh(self, store: Any) -> bool:
        """Read the controls now, whatever the age of this copy. True if they changed."""
        before = self._set
        self._claim_read()
        self._read(store)
        return self._set != before

    def _maybe_refresh(self, store: Any) -> None:
        age = time.monotonic() - self._read_at
        if age > CONTROL_REFRESH:
            # One thread reads; the others go on with this copy meanwhile (it is then a
            # round trip older at most), except before the first read.
            if self._claim_read() or self._read_at == float("-inf"):
                self._read(store)
        elif age > CONTROL_REFRESH / 2 and store.rtt_us >= RTT_COUNTS_FROM_US and self._claim_read():
            # A store far away: read again in the background before the copy is due, so
            # that no check waits a round trip for it while tasks keep coming.
            threading.Thread(target=self._read, args=(store,), daemon=True, name="celery_throttle controls").start()

    def _claim_read(self) -> bool:
        """Whether the caller is to read the controls: no other thread of this process is
        reading them (a reader of the process this one was forked from does not count)."""
        now = time.monotonic()
        with self._lock:
            reader = self._reader
            if reader is not None and reader[0] == os.getpid() and now - reader[1] < READ_GIVEN_UP:
                return False
            self._reader = (os.getpid(), now)
            return True

    def _read(self, store: Any) -> None:
        # The round trips outside the lock: a prefork pool may fork a process while another
        # thread reads, and a process that inherited the lock held would wait forever.
        controls, stamp, over, read_at_us = None, None, [], 0
        started = time.monotonic()
        try:
            stamp, read_at_us, raw = store.control_stamp_at()  # (raw: the hash whole if unstamped)
            if raw is None and (stamp != self._stamp or started - self._whole_at > FULL_READ_EVERY):
                # (The stamp of what this reads, whatever was written since the first.)
                stamp, raw = store.stamped_controls()
            if raw is not None:
                controls = parse_controls(raw)
                # (Over by the Redis clock of the stamp's read, a moment before: no round trip more.)
                over = [f for f, until in controls.pauses.items() if until < read_at_us][:PRUNE_BATCH]
        except StoreError:
            pass  # the check that follows meets the same store and says so
        with self._lock:
            if controls is not None:
                self._set, self._stamp, self._whole_at = controls, stamp, started
            if read_at_us:
                self.read_at_us = read_at_us
            self._read_at = time.monotonic()
            self._reader = None
        if over:
            try:
                store.prune_pauses(over)
            except StoreError:
                pass  # pruned by the next reader

    def as_of(self, now_us: int) -> int:
        """When a due time computed at ``now_us`` under this copy is news from, for the index
        of lines, whose newest news wins: no later than this copy was read. (A releaser that
        read its controls before a resume, and released after the resume's wake-up, would
        otherwise settle its key at the pause's end, newer than the wake-up: the tasks the
        pause held would wait it out.)"""
        return min(now_us, self.read_at_us) if self.read_at_us else now_us

    # -- the operators' writes: to the store, and noted here at once ----------------------
    def write_limit(self, store: Any, scope: str, key: str | None, rates: tuple[Rate, ...], replace: bool) -> str:
        """Set the live limit of ``scope``/``key`` to ``rates`` (``replace``: in place of
        every declared rate, else of those of the same window). Returns it as written."""
        field, value, replacing = limit_field(scope, key), ",".join(map(str, rates)), replace_field(scope, key)
        if replace:
            store.set_controls({field: value, replacing: REPLACE_ALL})
        else:
            store.set_controls({field: value}, clear=(replacing,))
        self.note(field, value)
        self.note(replacing, REPLACE_ALL if replace else None)
        return value

    def write_concurrency(self, store: Any, scope: str, key: str | None, concurrency: int) -> None:
        field = slots_field(scope, key)
        store.set_control(field, str(concurrency))
        self.note(field, str(concurrency))

    def clear_limits(self, store: Any, scope: str, key: str | None) -> bool:
        """Clear the live limits of ``scope``/``key`` (rates, concurrency, replace). True if
        one was set."""
        found = False
        for field in (limit_field(scope, key), slots_field(scope, key), replace_field(scope, key)):
            self.note(field, None)
            found = store.clear_control(field) or found
        return found

    def write_mode(self, store: Any, scope: str | None, key: str | None, mode: str | None) -> bool:
        """Set the live mode of ``scope``/``key`` (scope None: the app's), or clear it
        (None). True if one was set before."""
        field = mode_field(scope, key)
        if mode is None:
            found = store.clear_control(field)
        else:
            added = store.set_controls({field: mode})[0]  # (HSET's reply: the fields it added)
            found = added == 0
        self.note(field, mode)
        return found

    def note(self, field: str, value: str | None) -> None:
        """A control (or, with None, its removal) this process just wrote: obeyed at once."""
        with self._lock:
            current = self._set
            raw = {**{k: str(v) for k, v in current.pauses.items()},
                   **{k: ",".join(map(str, v)) for k, v in current.limits.items()},
                   **{k: str(v) for k, v in current.slots.items()},
                   **{"replace:" + f.removeprefix("limit:"): REPLACE_ALL for f in current.replacing},
                   **current.modes}
            if value is None:
                raw.pop(field, None)
            else:
                raw[field] = value
            # (The stamp now lags the hash: the next read reads it whole.)
            self._set, self._stamp = parse_controls(raw), None
