"""A pause after a store error, for the places that must never wait on Redis long.

The consumer's screen and the producer's check at publish are both optional: the pool's
check decides every start anyway. So after a store error (Redis down, or slower than the
short timeout they use), they stop calling Redis for a while and let the pool decide.
"""

from __future__ import annotations

import time

from ..core.locks import ForkSafeLock

__all__ = ["Breaker"]


class Breaker:
    """Open for ``pause`` seconds after :meth:`trip`; closed (calls go through) otherwise."""

    def __init__(self, pause: float) -> None:
        self.pause = pause
        self._until = 0.0
        self._lock = ForkSafeLock()

    @property
    def open(self) -> bool:
        return time.monotonic() < self._until

    def trip(self) -> None:
        with self._lock:
            self._until = time.monotonic() + self.pause
