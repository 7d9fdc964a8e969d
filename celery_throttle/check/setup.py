"""What every part of one app's throttle works with in this process: the app, its settings
(read from ``app.conf`` on first use: the app may be configured after ``install``, and again
after :meth:`Setup.configure`), its store by two connections (opened in the process that
uses them: a prefork child opens its own) and what it counts. Never another part: each part
is handed the parts it works with when the app's :class:`.limiter.Throttle` wires them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core import timing
from ..core.config import Settings, require_redis_url
from ..core.locks import ForkSafeLock
from ..store.client import RedisStore
from .metrics import Metrics

__all__ = ["Setup"]


class Setup:
    """One app's settings, store connections and counters in this process."""

    def __init__(self, app: Any, overrides: Mapping[str, Any] | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        self.app = app
        self._overrides = dict(overrides or {})
        self._clock = clock
        self._settings: Settings | None = None
        self._store: RedisStore | None = None
        self._quick_store: RedisStore | None = None
        self._metrics: Metrics | None = None
        self._lock = ForkSafeLock()
        #: The store's run id as the last store closed saw it (see :meth:`.RedisStore.report`).
        self._run_id: str | None = None

    def configure(self, overrides: Mapping[str, Any]) -> None:
        """Apply more overrides (``install`` called again with settings): read again, loudly
        now, with new store connections."""
        with self._lock:
            self._overrides.update(overrides)
            self._settings = None
        self.close()
        _ = self.settings

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_app(self.app, self._overrides)
        return self._settings

    @property
    def metrics(self) -> Metrics:
        """What this process counts (Prometheus with the extra) and logs about it."""
        if self._metrics is None:
            self._metrics = Metrics(with_keys=self.settings.metrics_keys)
        return self._metrics

    @property
    def store(self) -> RedisStore:
        """The Redis store, connected on first use (in the process that uses it)."""
        return self._store or self._open("_store")

    @property
    def quick_store(self) -> RedisStore:
        """The store, through a connection that gives up after QUICK_TIMEOUT."""
        return self._quick_store or self._open("_quick_store", timing.QUICK_TIMEOUT)

    def _open(self, attribute: str, quick_timeout: float | None = None) -> RedisStore:
        with self._lock:
            if getattr(self, attribute) is None:
                s = self.settings
                opened = RedisStore.opened(require_redis_url(self.app, s), s.key_prefix, s.redis_options,
                                           quick_timeout, clock=self._clock)
                other = self._quick_store if attribute == "_store" else self._store
                if other is not None:
                    opened.rtt_us = other.rtt_us  # (the same store, as far away)
                # (A store opened anew, settings applied again: a restart since its last
                # report is still told.)
                opened.run_id = self._run_id
                setattr(self, attribute, opened)
            store: RedisStore = getattr(self, attribute)
            return store

    def close(self) -> None:
        """Close the connections to the store (a later call opens new ones)."""
        with self._lock:
            for store in (self._store, self._quick_store):
                if store is not None:
                    self._run_id = store.run_id or self._run_id
                    store.close()
            self._store = self._quick_store = None
