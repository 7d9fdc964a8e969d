"""An outage of the store or the broker as a loop of ours meets it: logged once, summed up
while it lasts, and its end logged."""

from __future__ import annotations

import logging
import time

__all__ = ["OUTAGE_REPORT_EVERY", "Outage"]

logger = logging.getLogger("celery_throttle")

#: While the store is unreachable, the releaser says so again this often (seconds).
OUTAGE_REPORT_EVERY = 60.0


class Outage:
    """Store errors of one loop, logged once, summed up while they last, and their end."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None
        self.errors = 0
        self._reported_at = 0.0

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self.errors += 1
        if self.since is None:
            self.since, self._reported_at = now, now
            logger.warning("celery_throttle: could not %s: %s (said once; summed up every %.0fs until the "
                           "store is back)", self.what, exc, OUTAGE_REPORT_EVERY)
        elif now - self._reported_at >= OUTAGE_REPORT_EVERY:
            self._reported_at = now
            logger.warning("celery_throttle: still could not %s: %d errors in %.0fs; last: %s", self.what,
                           self.errors, now - self.since, exc)

    def ok(self) -> None:
        if self.since is not None:
            logger.warning("celery_throttle: the store is back: could %s again after %.1fs (%d errors)",
                           self.what, time.monotonic() - self.since, self.errors)
            self.since, self.errors = None, 0
