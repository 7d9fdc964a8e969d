"""What people on call set at run time, kept in Redis and obeyed by every worker: pauses.

One hash per app, ``<prefix>:control``; a field per paused scope (``pause:<scope>``) or
key (``pause:<scope>:<key>``, both encoded as in state keys), holding the end of the
pause in µs of the Redis clock (``FOREVER_US``: until resumed). Each process reads the
whole hash at most every ``CONTROL_REFRESH`` seconds and passes the pause of a call to
the window script, which reserves nothing before it: so a pause set anywhere holds on
every worker within that time, and the one that sets it (``ctl.pause``, a ``Backoff``)
obeys it at once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .errors import StoreError
from .keys import encode

__all__ = ["CONTROL_REFRESH", "FOREVER_US", "Controls", "pause_field"]

#: How stale (seconds) a process's copy of the pauses may be: a pause or a resume set
#: elsewhere is obeyed by every worker within this. One small read per process per
#: interval, whatever the task rate.
CONTROL_REFRESH = 0.5
#: The end of a pause with no end: the largest integer a Lua number holds exactly.
FOREVER_US = 2**53 - 1


def pause_field(scope: str, key: str | None) -> str:
    return f"pause:{encode(scope)}" if key is None else f"pause:{encode(scope)}:{encode(key)}"


class Controls:
    """This process's copy of the pauses, read again every CONTROL_REFRESH seconds."""

    def __init__(self) -> None:
        self._pauses: dict[str, int] = {}
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def paused_until(self, store: Any, scope: str, key: str | None) -> int:
        """The end of the pause (µs, Redis clock) covering ``scope``/``key``, or 0."""
        if time.monotonic() - self._read_at > CONTROL_REFRESH:
            self._refresh(store)
        pauses = self._pauses
        if not pauses:
            return 0
        until = pauses.get(pause_field(scope, None), 0)
        return max(until, pauses.get(pause_field(scope, key), 0)) if key is not None else until

    def _refresh(self, store: Any) -> None:
        with self._lock:
            if time.monotonic() - self._read_at <= CONTROL_REFRESH:
                return  # another thread just did
            try:
                self._pauses = store.pauses()
            except StoreError:
                pass  # the check that follows meets the same store and says so
            self._read_at = time.monotonic()

    def note(self, field: str, until_us: int | None) -> None:
        """A pause (or, with None, a resume) this process just wrote: obeyed at once."""
        with self._lock:
            pauses = dict(self._pauses)
            if until_us is None:
                pauses.pop(field, None)
            else:
                pauses[field] = until_us
            self._pauses = pauses
