"""What the throttle did, for people on call: Prometheus metrics and a log summary.

Metrics come with the ``prometheus`` extra (``pip install ".[prometheus]"``):
counters and a gauge in prometheus-client's default registry, so the worker's existing
exporter (``prometheus_client.start_http_server``, or multiprocess mode with prefork)
serves them. Labelled by scope; by key too only with ``throttle_metrics_keys = True``
(a tenant id per label value can grow without bound). Without the extra, nothing is
counted and nothing is imported.

Each process also logs, at INFO, a summary of its denials per scope and key once a
``SUMMARY_INTERVAL`` (and of what throttles in shadow mode would have held back) (when there were any; a thread of its own writes it, started at the
process's first denial), and a DEBUG line per denial.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any

from ..core.locks import ForkSafeLock

__all__ = ["SUMMARY_INTERVAL", "Metrics"]

logger = logging.getLogger("celery_throttle")

#: Seconds between two INFO summaries of one process's denials.
SUMMARY_INTERVAL = 60.0

try:  # the prometheus extra
    import prometheus_client
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    prometheus_client = None  # type: ignore[assignment]

_instruments: dict[str, Any] = {}
_instruments_lock = ForkSafeLock()


def _instrument(kind: str, name: str, documentation: str, labels: tuple[str, ...], **options: Any) -> Any:
    """One instrument per name and label set in this process (the default registry
    refuses a second one of the same name)."""
    ident = f"{name}:{','.join(labels)}"
    with _instruments_lock:
        if ident not in _instruments:
            cls = getattr(prometheus_client, kind)
            try:
                _instruments[ident] = cls(name, documentation, labels, **options)
            except ValueError:  # registered by another app of this process with other labels
                _instruments[ident] = None
        return _instruments[ident]


class Metrics:
    """Counts what the throttle does in this process (a no-op without the extra)."""

    def __init__(self, with_keys: bool = False) -> None:
        self.with_keys = with_keys
        self.enabled = prometheus_client is not None
        labels = ("scope", "key") if with_keys else ("scope",)
        if self.enabled:
            self._admitted = _instrument("Counter", "celery_throttle_admitted",
                                         "Task starts the throttle admitted", labels)
            self._denied = _instrument("Counter", "celery_throttle_denied",
                                       "Task starts the throttle deferred", labels)
            self._deferred = _instrument("Counter", "celery_throttle_deferred_seconds",
                                         "Seconds denied tasks were deferred for", labels)
            self._parked = _instrument("Counter", "celery_throttle_parked",
                                       "Denied tasks that joined their key's line", labels)
            self._wait_exceeded = _instrument("Counter", "celery_throttle_wait_exceeded",
                                              "Tasks failed with WaitTooLong: their wait was past their max_wait",
                                              labels)
            self._released = _instrument("Counter", "celery_throttle_released",
                                         "Tasks released from a line, sent to the broker", ())
            self._store_errors = _instrument("Counter", "celery_throttle_store_errors",
                                             "Checks that could not reach Redis", ("where",))
            self._lost = _instrument("Counter", "celery_throttle_parked_lost",
                                     "Tasks due in a line whose message is gone from the store", ())
            self._waiting = _instrument("Gauge", "celery_throttle_parked_waiting",
                                        "Tasks waiting in every line", ())
            # (Each process counts the slots it holds; with prefork's multiprocess mode the
            # live processes' values are summed: the slots held on this host.)
            self._running = _instrument("Gauge", "celery_throttle_slots_running",
                                        "Concurrency slots held by bodies that run", labels,
                                        multiprocess_mode="livesum")
            # (Every worker's releaser reads the same levels from the store: the lowest of
            # their values is the level, whichever worker is scraped.)
            self._adaptive = _instrument("Gauge", "celery_throttle_adaptive_level",
                                         "Share of its declared rates an adaptive throttle is in force at (1: all)",
                                         labels, multiprocess_mode="min")
            self._adaptive_floor = _instrument("Gauge", "celery_throttle_adaptive_floor",
                                               "The lowest share of its declared rates an adaptive throttle goes to",
                                               labels, multiprocess_mode="min")
            self._shadow_checked = _instrument("Counter", "celery_throttle_shadow_checked",
                                               "Task starts checked by a throttle in shadow mode", labels)
            self._shadow_held = _instrument("Counter", "celery_throttle_shadow_held",
                                            "Task starts a throttle in shadow mode would have held back", labels)
            self._shadow_seconds = _instrument("Counter", "celery_throttle_shadow_held_seconds",
                                               "Seconds the starts a throttle in shadow mode would have held back "
                                               "would have waited", labels)
        self._lock = ForkSafeLock()
        #: (scope, key) -> [checked, held back, seconds they would have waited, the longest]
        self._shadowed: dict[tuple[str, str | None], list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
        self._denials: dict[tuple[str, str | None], list[float]] = defaultdict(lambda: [0, 0.0])
        self._summary_at = time.monotonic()
        self._summarizer_pid: int | None = None

    def _labels(self, scope: str, key: str | None) -> tuple[str, ...]:
        return (scope, key or "") if self.with_keys else (scope,)

    def admitted(self, scope: str, key: str | None) -> None:
        if self.enabled and self._admitted is not None:
            self._admitted.labels(*self._labels(scope, key)).inc()

    def denied(self, scope: str, key: str | None, delay: float) -> None:
        """A task was denied and waits in its key's line (about ``delay`` seconds)."""
        if self.enabled and self._denied is not None:
            labels = self._labels(scope, key)
            self._denied.labels(*labels).inc()
            self._deferred.labels(*labels).inc(max(delay, 0.0))
            self._parked.labels(*labels).inc()
        with self._lock:
            entry = self._denials[(scope, key)]
            entry[0] += 1
            entry[1] += max(delay, 0.0)
        if self._summarizer_pid != os.getpid():
            self._start_summarizer()
        self.summarize()

    def shadowed(self, scope: str, key: str | None, wait: float | None) -> None:
        """A throttle in shadow mode checked a start: it would have waited ``wait``
        seconds (None: it would have run now)."""
        if self.enabled and self._shadow_checked is not None:
            labels = self._labels(scope, key)
            self._shadow_checked.labels(*labels).inc()
            if wait is not None:
                self._shadow_held.labels(*labels).inc()
                self._shadow_seconds.labels(*labels).inc(wait)
        with self._lock:
            entry = self._shadowed[(scope, key)]
            entry[0] += 1
            if wait is not None:
                entry[1] += 1
                entry[2] += wait
                entry[3] = max(entry[3], wait)
        if self._summarizer_pid != os.getpid():
            self._start_summarizer()
        self.summarize()

    def _start_summarizer(self) -> None:
        """A thread that writes the summary on its interval, denials or not (one per
        process: a prefork child does not inherit its parent's)."""
        self._summarizer_pid = os.getpid()

        def loop() -> None:
            while True:
                time.sleep(max(self._summary_at + SUMMARY_INTERVAL - time.monotonic(), 0.0) + 0.01)
                try:
                    self.summarize()
                except Exception:  # never let a log line end the thread
                    logger.exception("could not write the throttle summary")

        threading.Thread(target=loop, name="celery-throttle-summary", daemon=True).start()

    def wait_exceeded(self, scope: str, key: str | None) -> None:
        """A task failed with WaitTooLong (signal ``task_wait_exceeded``)."""
        if self.enabled and self._wait_exceeded is not None:
            self._wait_exceeded.labels(*self._labels(scope, key)).inc()

    def running(self, scope: str, key: str | None, change: int) -> None:
        """A body took (1) or gave back (-1) a concurrency slot."""
        if self.enabled and self._running is not None:
            self._running.labels(*self._labels(scope, key)).inc(change)

    def lost(self, count: int = 1) -> None:
        if self.enabled and self._lost is not None:
            self._lost.inc(count)

    def released(self, count: int) -> None:
        if self.enabled and self._released is not None and count:
            self._released.inc(count)

    def store_error(self, where: str) -> None:
        if self.enabled and self._store_errors is not None:
            self._store_errors.labels(where).inc()

    def adaptive(self, scope: str, key: str | None, share: float, floor: float) -> None:
        """An adaptive throttle's level now, and its floor (shares of its declared rates)."""
        if self.enabled and self._adaptive is not None:
            labels = self._labels(scope, key)
            self._adaptive.labels(*labels).set(share)
            self._adaptive_floor.labels(*labels).set(floor)

    def parked_waiting(self, count: int) -> None:
        if self.enabled and self._waiting is not None:
            self._waiting.set(count)

    def summarize(self, force: bool = False) -> None:
        """Log the denials since the last summary, once SUMMARY_INTERVAL has passed."""
        now = time.monotonic()
        if not force and now - self._summary_at < SUMMARY_INTERVAL:
            return
        with self._lock:
            denials, self._denials = self._denials, defaultdict(lambda: [0, 0.0])
            shadowed, self._shadowed = self._shadowed, defaultdict(lambda: [0, 0, 0.0, 0.0])
            span, self._summary_at = now - self._summary_at, now
        for (scope, key), (checked, held, waited, longest) in sorted(shadowed.items(), key=lambda i: -i[1][1]):
            logger.info("shadow mode in the last %.0fs: scope=%s key=%s: %d of %d task(s) would have been held "
                        "back%s", span, _shown(scope), _shown(key), held, checked,
                        f", {waited / held:.1f}s on average, {longest:.1f}s at most" if held else "")
        for (scope, key), (count, seconds) in sorted(denials.items(), key=lambda i: -i[1][0]):
            # (scope and key quoted: user data, whose newlines would forge log lines)
            logger.info("throttled in the last %.0fs: scope=%s key=%s: %d task(s) deferred, %.1fs on average",
                        span, _shown(scope), _shown(key), count, seconds / count)


def _shown(text: str | None) -> str:
    """User data in a log line: as it is, unless it holds what is not printable (then
    its repr, so a newline or an escape sequence never reaches the log raw)."""
    if text is None:
        return "None"
    return text if text.isprintable() else repr(text)
