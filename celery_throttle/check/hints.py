"""What a producer may send unchecked at publish, learnt from the check's replies (see
:mod:`.publish`)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from ..core.locks import ForkSafeLock
from ..core.protocol import Cost
from ..core.timing import PUBLISH_HINTS_KEPT

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

    A call whose rates count different units (requests and tokens) has a budget per rate:
    a send is taken from each (:data:`.protocol.Cost`), and fits while each has room.
    """

    #: What :meth:`take` answers.
    SEND, RESERVE, ASK = "send", "reserve", "ask"

    def __init__(self, kept: int = PUBLISH_HINTS_KEPT) -> None:
        self._lock = ForkSafeLock()
        self._kept = kept
        #: state key -> [deadline (monotonic seconds), units left: of every rate, or per rate]
        self._hints: OrderedDict[str, list[Any]] = OrderedDict()

    def take(self, key: str, cost: Cost) -> str:
        """SEND: ``cost`` units taken from the key's budget. RESERVE: the budget ran out
        in this hint. ASK: no hint (an old one, or one of calls costing otherwise): check."""
        with self._lock:
            hint = self._hints.get(key)
            if hint is None:
                return self.ASK
            deadline, left = hint
            if deadline <= time.monotonic() or _shape(left) != _shape(cost):
                del self._hints[key]
                return self.ASK
            if isinstance(left, int) and isinstance(cost, int):
                if left < cost:
                    return self.RESERVE
                hint[1] = left - cost
                return self.SEND
            if any(room < units for room, units in zip(left, cost)):  # type: ignore[arg-type]
                return self.RESERVE
            hint[1] = tuple(room - units for room, units in zip(left, cost))  # type: ignore[arg-type]
            return self.SEND

    def open(self, key: str, units: Cost, seconds: float) -> None:
        """The key may take ``units`` (of every rate, or per rate) more unchecked sends
        within ``seconds``."""
        left = max(units, 0) if isinstance(units, int) else tuple(max(u, 0) for u in units)
        with self._lock:
            self._hints[key] = [time.monotonic() + seconds, left]
            self._hints.move_to_end(key)
            while len(self._hints) > self._kept:
                self._hints.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._hints.clear()


def _shape(cost: Cost) -> int:
    """0 for units of every rate, else the number of rates counted one by one."""
    return 0 if isinstance(cost, int) else len(cost)
