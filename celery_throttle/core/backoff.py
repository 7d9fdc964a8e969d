"""Back-off from downstream: a task that meets a 429 or a 503 pauses its throttle.

>>> r = http.get(url)
>>> celery_throttle.backoff_from(r)      # raises Backoff on 429/503, else returns r

or ``raise celery_throttle.Backoff(retry_after=r.headers.get("Retry-After"))``. The
task's scope (and key) is paused on every worker for that long (``Throttle.pause``), and
the task itself is sent back to run after the pause, without spending its retry budget.
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

from .errors import ThrottleError

__all__ = ["DEFAULT_BACKOFF", "MIN_BACKOFF", "Backoff", "backoff_from", "retry_after_seconds"]

#: Seconds to pause when the API gave no usable Retry-After (none, or unreadable).
DEFAULT_BACKOFF = 30.0
#: The shortest pause: a Retry-After of 0 (or a date already past) still means "not now".
MIN_BACKOFF = 1.0
#: Statuses that ask a client to slow down.
BACKOFF_STATUSES = (429, 503)


class Backoff(ThrottleError):
    """Raised from a throttled task's body: pause its scope (and key) for
    ``retry_after`` and run this task again after the pause.

    ``retry_after``: seconds (a number or a numeric string) or an HTTP date, as a
    ``Retry-After`` header gives it; None or anything unreadable: DEFAULT_BACKOFF.
    ``whole_scope``: pause every key of the scope, not only this call's key.
    """

    def __init__(self, retry_after: Any = None, *, whole_scope: bool = False) -> None:
        self.seconds = retry_after_seconds(retry_after)
        self.whole_scope = whole_scope
        super().__init__(f"backing off for {self.seconds:.1f}s (Retry-After: {retry_after!r})")


def retry_after_seconds(value: Any, now: float | None = None) -> float:
    """Seconds to wait for a ``Retry-After`` value: a number of seconds or an HTTP date."""
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, datetime):
        seconds = value.timestamp() - (time.time() if now is None else now)
    elif isinstance(value, (str, bytes)):
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        try:
            seconds = float(text.strip())
        except ValueError:
            try:
                seconds = parsedate_to_datetime(text).timestamp() - (time.time() if now is None else now)
            except (TypeError, ValueError, IndexError):
                seconds = None
    if seconds is None or not math.isfinite(seconds):
        return DEFAULT_BACKOFF
    return max(seconds, MIN_BACKOFF)


def backoff_from(response: Any, *, default: float = DEFAULT_BACKOFF) -> Any:
    """Raise :class:`Backoff` for a 429 or 503 response (``requests``, ``httpx``, or
    anything with ``status_code``/``status`` and ``headers``); return it otherwise."""
    status = getattr(response, "status_code", None)
    if status is None:
        status = getattr(response, "status", None)
    if status in BACKOFF_STATUSES:
        headers = getattr(response, "headers", None) or {}
        raise Backoff(retry_after=headers.get("Retry-After", default))
    return response
