"""What people on call set at run time, kept in Redis and obeyed by every worker:
pauses and live limits.

One hash per app, ``<prefix>:control``. A field per paused scope (``pause:<scope>``) or
key (``pause:<scope>:<key>``, both encoded as in state keys) holds the end of the pause
in µs of the Redis clock (``FOREVER_US``: until resumed); a field per live limit
(``limit:<scope>`` or ``limit:<scope>:<key>``) holds its rates (``"10/s,5000/h"``), and
one per live concurrency limit (``slots:<scope>`` or ``slots:<scope>:<key>``) its K. A
live limit takes the place of the declared rates of its windows only (a live ``2/s`` on
``10/s, 5000/h``: ``2/s, 5000/h``, :func:`merged_rates`), unless a field
``replace:<scope>[:<key>]`` beside it says it replaces them all (a separate field: an
earlier version reads the limit alone, and replaces them all, as it always did). Each
process reads the whole hash at most every ``CONTROL_REFRESH`` seconds: a control set
anywhere holds on every worker within that time, and the process that sets it obeys it
at once.

The hash can be large (a ``Backoff`` per tenant pauses one field per key: 50 000 of them
are about 5 MB), so it is not read whole every time. Every write adds one to its field
``~stamp`` in the same transaction, and a process first reads the stamp alone: the hash
only when the stamp moved, or when ``FULL_READ_EVERY`` has passed (a field written by
hand, without the stamp, is obeyed within that time; a hash no write ever stamped, one
an earlier version alone wrote, is read whole every time, as before). The process that
reads pauses that are over deletes them (at most ``PRUNE_BATCH`` a read, each only if
still over), so the hash holds the pauses in force and not every one ever set.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from ..core.errors import ConfigurationError, StoreError
from ..core.keys import decode, encode
from ..core.locks import ForkSafeLock
from ..core.rates import Rate, parse_rates
from ..core.timing import CONTROL_REFRESH, RTT_COUNTS_FROM_US, STORE_TIMEOUT

__all__ = ["CONTROL_REFRESH", "FULL_READ_EVERY", "PRUNE_BATCH", "REPLACE_ALL",
           "ControlSet", "Controls", "control_target", "limit_field", "merged_rates", "pause_field", "replace_field",
           "slots_field"]

logger = logging.getLogger("celery_throttle")

#: A read of the controls under way for longer than this (seconds: the store's timeout,
#: and some) is taken for lost, and another thread reads.
READ_GIVEN_UP = STORE_TIMEOUT + 1.0
#: The value of a ``replace:`` field (not all digits: pause.lua prunes those as pauses over).
REPLACE_ALL = "all"
#: A stamped hash is read whole at least this often (seconds) even when its stamp has not
#: moved: a field written by hand (redis-cli HSET, without HINCRBY ~stamp 1) takes effect
#: within this time. A minute's worth of refreshes: at 50 000 pauses the reads cost a
#: process 120 times less than a read every refresh.
FULL_READ_EVERY = 60.0
#: Pauses that are over deleted per read, at most: one script call's work stays small.
PRUNE_BATCH = 500


def _field(kind: str, scope: str, key: str | None) -> str:
    return f"{kind}:{encode(scope)}" if key is None else f"{kind}:{encode(scope)}:{encode(key)}"


def control_target(field: str) -> tuple[str, str | None] | None:
    """(scope, key) a control field names, or None for a field we do not write."""
    kind, _, rest = field.partition(":")
    if kind not in ("pause", "limit", "slots") or not rest:
        return None
    scope, sep, key = rest.partition(":")
    return decode(scope), (decode(key) if sep else None)


def pause_field(scope: str, key: str | None) -> str:
    return _field("pause", scope, key)


def limit_field(scope: str, key: str | None) -> str:
    return _field("limit", scope, key)


def slots_field(scope: str, key: str | None) -> str:
    return _field("slots", scope, key)


def replace_field(scope: str, key: str | None) -> str:
    """The field that makes the live limit of ``scope``/``key`` replace every declared rate."""
    return _field("replace", scope, key)


def merged_rates(declared: tuple[Rate, ...], live: tuple[Rate, ...], replace_all: bool = False) -> tuple[Rate, ...]:
    """The rates in force under a live limit: ``live``, and each ``declared`` rate of a
    window length and unit that ``live`` does not set (none with ``replace_all``). A live
    ``2/s`` on ``10/s, 5000/h`` gives ``2/s, 5000/h``: lowering one rate in an incident
    must not lift a quota of another window."""
    if replace_all:
        return live
    windows = {(r.period_us, r.unit) for r in live}
    return tuple(sorted({*live, *(r for r in declared if (r.period_us, r.unit) not in windows)}))


class ControlSet(NamedTuple):
    """The controls set: pauses (field to end, µs), live limits (field to rates), live
    concurrency limits (field to K), and the live limits that replace every declared rate
    (their ``limit:`` fields)."""

    pauses: dict[str, int]
    limits: dict[str, tuple[Rate, ...]]
    slots: dict[str, int]
    replacing: frozenset[str] = frozenset()

    def fields(self) -> list[str]:
        return [*self.pauses, *self.limits, *self.slots]

    def paused_until(self, scope: str, key: str | None) -> int:
        """The end of the pause (µs, Redis clock) covering ``scope``/``key``, or 0."""
        pauses = self.pauses
        if not pauses:
            return 0
        until = pauses.get(pause_field(scope, None), 0)
        return max(until, pauses.get(pause_field(scope, key), 0)) if key is not None else until

    def limit_of(self, scope: str, key: str | None) -> tuple[Rate, ...] | None:
        """The live limit of ``scope``/``key`` (the key's own first), or None."""
        limits = self.limits
        if not limits:
            return None
        return (key is not None and limits.get(limit_field(scope, key))) or limits.get(limit_field(scope, None))

    def replaces_all(self, scope: str, key: str | None) -> bool:
        """Whether the live limit :meth:`limit_of` finds replaces every declared rate."""
        limits = self.limits
        if not limits:
            return False
        own = limit_field(scope, key) if key is not None else None
        field = own if own is not None and own in limits else limit_field(scope, None)
        return field in self.replacing

    def rates_of(self, scope: str, key: str | None, declared: tuple[Rate, ...]) -> tuple[Rate, ...]:
        """The rates in force for a call of ``scope``/``key`` that declares ``declared``:
        :func:`merged_rates` under its live limit, if one is set, else ``declared``."""
        live = self.limit_of(scope, key)
        if live is None:
            return declared
        return merged_rates(declared, live, self.replaces_all(scope, key))

    def concurrency_of(self, scope: str, key: str | None) -> int | None:
        """The live concurrency limit of ``scope``/``key`` (the key's own first), or None."""
        slots = self.slots
        if not slots:
            return None
        return (key is not None and slots.get(slots_field(scope, key))) or slots.get(slots_field(scope, None))


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
        controls, stamp, over = None, None, []
        started = time.monotonic()
        try:
            stamp = store.control_stamp()
            if stamp is None or stamp != self._stamp or started - self._whole_at > FULL_READ_EVERY:
                # (The stamp of what this reads, whatever was written since the first.)
                stamp, raw = store.stamped_controls()
                controls = parse_controls(raw)
                if controls.pauses:  # (the Redis clock only when there is a pause to compare)
                    now_us = store.now_us()
                    over = [f for f, until in controls.pauses.items() if until < now_us][:PRUNE_BATCH]
        except StoreError:
            pass  # the check that follows meets the same store and says so
        with self._lock:
            if controls is not None:
                self._set, self._stamp, self._whole_at = controls, stamp, started
            self._read_at = time.monotonic()
            self._reader = None
        if over:
            try:
                store.prune_pauses(over)
            except StoreError:
                pass  # pruned by the next reader

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

    def note(self, field: str, value: str | None) -> None:
        """A control (or, with None, its removal) this process just wrote: obeyed at once."""
        with self._lock:
            current = self._set
            raw = {**{k: str(v) for k, v in current.pauses.items()},
                   **{k: ",".join(map(str, v)) for k, v in current.limits.items()},
                   **{k: str(v) for k, v in current.slots.items()},
                   **{"replace:" + f.removeprefix("limit:"): REPLACE_ALL for f in current.replacing}}
            if value is None:
                raw.pop(field, None)
            else:
                raw[field] = value
            # (The stamp now lags the hash: the next read reads it whole.)
            self._set, self._stamp = parse_controls(raw), None


def parse_controls(raw: Mapping[str, str]) -> ControlSet:
    """(pauses, live limits, live concurrency limits) from the control hash; a value that
    does not read is skipped (with a log line), never fatal: the hash is written by hand
    too, through redis-cli."""
    controls = ControlSet({}, {}, {})
    replacing: set[str] = set()
    for field, value in raw.items():
        try:
            if field.startswith("pause:"):
                controls.pauses[field] = int(value)
            elif field.startswith("limit:"):
                controls.limits[field] = parse_rates(value.split(","))
            elif field.startswith("slots:"):
                concurrency = int(value)
                if concurrency < 1:
                    raise ValueError(f"a concurrency limit is at least 1, got {concurrency}")
                controls.slots[field] = concurrency
            elif field.startswith("replace:"):
                replacing.add("limit:" + field.removeprefix("replace:"))
        except (ValueError, ConfigurationError) as exc:
            if (field, value) not in _warned:
                _warned.add((field, value))
                logger.warning("celery_throttle: ignoring control %s=%r: %s", field, value, exc)
    return controls._replace(replacing=frozenset(replacing)) if replacing else controls


_warned: set[tuple[str, str]] = set()  # (each bad control is logged once per process)
