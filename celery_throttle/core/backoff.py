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

__all__ = ["DEFAULT_BACKOFF", "FIRST_UNASKED_BACKOFF", "MIN_BACKOFF", "Backoff", "backoff_from", "read_retry_after",
           "retry_after_seconds"]

#: The longest pause a refusal without a usable Retry-After (none, or unreadable) gets,
#: after it repeated: most 503s and many 429s say nothing, and a long pause for each one
#: would hold a scope still long after the API has room again.
DEFAULT_BACKOFF = 30.0
#: The first pause of a refusal without a usable Retry-After (where the throttle does not
#: adapt: an adaptive limit's lowered level is the answer, and nothing is paused). It
#: doubles while such refusals repeat, up to DEFAULT_BACKOFF (integration/backing_off.py).
FIRST_UNASKED_BACKOFF = 1.0
#: The shortest pause: a Retry-After of 0 (or a date already past) still means "not now".
MIN_BACKOFF = 1.0
#: Statuses that ask a client to slow down.
BACKOFF_STATUSES = (429, 503)


class Backoff(ThrottleError):
    """Raised from a throttled task's body: pause its scope (and key) for
    ``retry_after`` and run this task again after the pause.

    ``retry_after``: seconds (a number or a numeric string) or an HTTP date, as a
    ``Retry-After`` header gives it. None or anything unreadable: the API did not say
    (:attr:`asked` is None): an adaptive throttle lowers its limit and pauses nothing;
    another pauses FIRST_UNASKED_BACKOFF, doubling while such refusals repeat, up to
    DEFAULT_BACKOFF. ``whole_scope``: pause every key of the scope, not only this call's key.
    """

    def __init__(self, retry_after: Any = None, *, whole_scope: bool = False) -> None:
        #: The seconds the API asked for (None: it did not say).
        self.asked = read_retry_after(retry_after)
        #: The pause if this refusal is the first of its kind (see integration/backing_off.py).
        self.seconds = FIRST_UNASKED_BACKOFF if self.asked is None else self.asked
        self.whole_scope = whole_scope
        said = "no Retry-After" if self.asked is None else f"Retry-After: {retry_after!r}"
        super().__init__(f"backing off ({said})")


def retry_after_seconds(value: Any, now: float | None = None) -> float:
    """Seconds to wait for a ``Retry-After`` value: a number of seconds or an HTTP date;
    DEFAULT_BACKOFF for anything else."""
    seconds = read_retry_after(value, now)
    return DEFAULT_BACKOFF if seconds is None else seconds


def read_retry_after(value: Any, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` value asks for (a number of seconds or an HTTP date, at
    least MIN_BACKOFF), or None: absent or unreadable."""
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
        return None
    return max(seconds, MIN_BACKOFF)


def backoff_from(response: Any, *, default: float | None = None) -> Any:
    """Raise :class:`Backoff` for a 429 or 503 response (``requests``, ``httpx``, or
    anything with ``status_code``/``status`` and ``headers``); return it otherwise.
    ``default``: the seconds to pause when the response has no usable ``Retry-After``
    (None: as :class:`Backoff` does when the API does not say)."""
    status = getattr(response, "status_code", None)
    if status is None:
        status = getattr(response, "status", None)
    if status in BACKOFF_STATUSES:
        headers = getattr(response, "headers", None) or {}
        asked = read_retry_after(headers.get("Retry-After"))
        raise Backoff(retry_after=asked if asked is not None else default)
    return response
