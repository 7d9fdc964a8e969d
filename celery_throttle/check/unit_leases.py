"""Leases: units a pool process takes at once for a busy key far below its limit.

A task under its limit pays one Redis round trip per start; for a key that runs many
tasks a second with plenty of room, that round trip is most of what throttling costs.
So when a process keeps calling the same key, its check asks for a lease: as many units
as it expects to use within a short span. window.lua grants them only while every rate
stays at most half full, and records them as starting anywhere in [now, now + span],
exactly as if each had been admitted. The process then admits its next calls locally
while the span lasts. Near the limit no lease is granted, and every start is checked
one by one again.

Times: the lease ends at a Redis time; the process measures how far it is from that end
with its monotonic clock, from the moment it sent the request (so it errs early).

Threads: the table is the process's, shared by every thread (or greenlet) of a threads,
gevent or eventlet pool, so each method holds a lock while it reads and changes it: two
threads must never both spend the last leased unit. The lock is held for a few dict and
integer operations only, never across I/O (with gevent or eventlet it is a green lock).
"""

from __future__ import annotations

import os
import time
from collections.abc import Hashable
from dataclasses import dataclass

from ..core.locks import ForkSafeLock

__all__ = ["Leases"]

#: The most units one lease asks for.
MAX_UNITS = 64
#: Keys tracked per process; past this the table starts afresh.
MAX_KEYS = 10_000


def _now_us() -> int:
    return time.monotonic_ns() // 1000


@dataclass
class _Key:
    last_call_us: int
    #: Smoothed time between calls of this key in this process (µs); 0 until known.
    interval_us: float = 0.0
    units: int = 0
    #: When the lease ends, on this process's monotonic clock.
    ends_us: int = 0


class Leases:
    """The leases of one process (a forked child starts with none)."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._keys: dict[Hashable, _Key] = {}
        self._lock = ForkSafeLock()  # (free in a forked child: see locks.py)

    def _table(self) -> dict[Hashable, _Key]:
        """The table, to use under ``self._lock``."""
        if self._pid != os.getpid():  # inherited through a fork: not this process's
            self._pid, self._keys = os.getpid(), {}
        return self._keys

    def take(self, ident: Hashable, cost: int, slack_us: int) -> bool:
        """Use ``cost`` leased units of ``ident`` for a call starting within ``slack_us``."""
        with self._lock:
            table = self._table()
            now = _now_us()
            key = table.get(ident)
            if key is None:
                if len(table) >= MAX_KEYS:
                    table.clear()
                table[ident] = _Key(now)
                return False
            gap = now - key.last_call_us
            key.interval_us = gap if not key.interval_us else 0.8 * key.interval_us + 0.2 * gap
            key.last_call_us = now
            if key.units >= cost and now + slack_us <= key.ends_us:
                key.units -= cost
                return True
            key.units = 0
            return False

    def wanted(self, ident: Hashable, cost: int, span_us: int) -> int:
        """Units to ask for in the next check of ``ident`` (0: no lease): the calls this
        process expects within ``span_us`` at its recent pace."""
        with self._lock:
            key = self._table().get(ident)
            if key is None or not key.interval_us:
                return 0
            calls = min(int(span_us / max(key.interval_us, 1.0)), MAX_UNITS)
        return calls * cost if calls >= 2 else 0

    def grant(self, ident: Hashable, units: int, span_us: int, sent_us: int) -> None:
        """Keep ``units`` more for ``ident``, usable until ``span_us`` after the request
        was sent (the lease runs from the script's time, which is later). Units still
        held from an earlier lease are dropped (they count in the window all the same)."""
        with self._lock:
            key = self._table().get(ident)
            if key is not None:
                key.units, key.ends_us = units, sent_us + span_us


def sent_at() -> int:
    """The monotonic time to pass to :meth:`Leases.grant` (taken before the request)."""
    return _now_us()
