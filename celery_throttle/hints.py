"""What a producer may send unchecked at publish, learnt from the check's replies (see
:mod:`.publish`)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from .timing import PUBLISH_HINTS_KEPT

__all__ = ["Hints"]


class Hints:
    """Units this process may send unchecked, per state key, until a deadline.

    Taken from the check's replies: a key with room answers how many units it may still
    take before one of its rates is half full; that budget is spent by this process's
    sends until it runs out or the hint ends (the shortest window, at most
    PUBLISH_HINT_MAX). A key whose budget ran out is checked with a reservation for the
    rest of the hint: the budget counts the tasks this process sent that no worker has
    counted yet, so a queue that fills while no worker runs holds at most half a window's
    limit of a key per producer and hint. Only fairness rests on it: every start is still
    checked by the worker, so no window is broken whatever a hint says.
    """

    #: What :meth:`take` answers.
    SEND, RESERVE, ASK = "send", "reserve", "ask"

    def __init__(self, kept: int = PUBLISH_HINTS_KEPT) -> None:
        self._lock = threading.Lock()
        self._kept = kept
        #: state key -> [deadline (monotonic seconds), units left]
        self._hints: OrderedDict[str, list[float]] = OrderedDict()

    def take(self, key: str, cost: int) -> str:
        """SEND: ``cost`` units taken from the key's budget. RESERVE: the budget ran out
        in this hint. ASK: no hint (or an old one): check."""
        with self._lock:
            hint = self._hints.get(key)
            if hint is None:
                return self.ASK
            if hint[0] <= time.monotonic():
                del self._hints[key]
                return self.ASK
            if hint[1] >= cost:
                hint[1] -= cost
                return self.SEND
            return self.RESERVE

    def open(self, key: str, units: int, seconds: float) -> None:
        """The key may take ``units`` more unchecked sends within ``seconds``."""
        with self._lock:
            self._hints[key] = [time.monotonic() + seconds, float(max(units, 0))]
            self._hints.move_to_end(key)
            while len(self._hints) > self._kept:
                self._hints.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._hints.clear()
