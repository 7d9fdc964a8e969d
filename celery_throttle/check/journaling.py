"""This process's writes to the journal (:mod:`celery_throttle.core.journal`): a task that
joins a line is ``kept`` there, one that leaves it for good is ``gone``.

On by default when the broker is RabbitMQ (``throttle_journal``, None: by the broker),
whose queues keep messages on disk while the store that holds the lines may not. Off with
a Redis broker: the store is then usually the broker itself, and a copy in it would be
no more durable than the line (``throttle_journal = True`` writes one all the same).

A write that fails (the broker unreachable) is logged and counted, and nothing else
happens: the task still waits in its line, as it would without a journal. Never raises.

Each ``kept`` event names the store's epoch (``core/journal.py``): read by this process at
most every EPOCH_REFRESH seconds, and made by the first writer that finds none (a store
that restarted empty).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..celery_parts.journal import BrokerJournal
from ..core.journal import Kind
from ..core.keys import journal_keys
from ..core.locks import ForkSafeLock
from .binding import Stores

if TYPE_CHECKING:
    from celery import Celery

    from .metrics import Metrics

__all__ = ["RABBITMQ_SCHEMES", "Journaling", "journal_on", "store_epoch"]

logger = logging.getLogger("celery_throttle")

#: Broker URL schemes of RabbitMQ, with which the journal is on by default.
RABBITMQ_SCHEMES = ("amqp", "amqps", "pyamqp", "librabbitmq")
#: A failing journal is said again at most this often (seconds) by one process.
REPORT_EVERY = 60.0
#: How long (seconds) a process trusts the epoch it read. A task kept in the second after a
#: store restarted empty may name the epoch before: harmless, as the keeper sends on only a
#: task the store does not hold, and the new store holds it.
EPOCH_REFRESH = 1.0


def store_epoch(store: Any) -> str:
    """The store's epoch, made now if it has none (raises StoreError)."""
    key = journal_keys(store.prefix)[0]
    with store.errors():
        value = store.client.hget(key, "epoch")
        if value is None:
            store.client.hsetnx(key, "epoch", secrets.token_hex(12))
            value = store.client.hget(key, "epoch")
    return value.decode() if isinstance(value, bytes) else str(value)


def journal_on(app: Any, setting: bool | None) -> bool:
    """Whether tasks waiting in lines are journaled in ``app``'s broker."""
    if setting is not None:
        return setting
    url = app.conf.broker_url
    url = url[0] if isinstance(url, (list, tuple)) and url else url
    scheme = str(url or "").split(";", 1)[0].split("://", 1)[0].lower()
    return scheme in RABBITMQ_SCHEMES


class Owner(Stores, Protocol):
    """What the journal works with: the settings, the store, the app (its broker) and the
    metrics (its failures)."""

    @property
    def app(self) -> Celery: ...

    @property
    def metrics(self) -> Metrics: ...


class Journaling:
    """The journal of one app, as this process writes it."""

    def __init__(self, ctl: Owner) -> None:
        self.ctl = ctl
        self._broker: BrokerJournal | None = None
        self._enabled = False
        #: The settings ``_enabled`` and ``_broker`` were made for (install() again with
        #: other settings makes new ones).
        self._for: Any = None
        self._lock = ForkSafeLock()
        self._reported_at = float("-inf")
        self._failures = 0
        self._epoch: tuple[str, float] | None = None  # (epoch, when read: monotonic)

    @property
    def enabled(self) -> bool:
        settings = self.ctl.settings
        if self._for is not settings:
            self._enabled = journal_on(self.ctl.app, settings.journal)
            self._broker = BrokerJournal(self.ctl.app, settings.key_prefix)
            self._for = settings
        return self._enabled

    @property
    def broker(self) -> BrokerJournal:
        """The journal's queue (whether or not it is on)."""
        _ = self.enabled
        assert self._broker is not None
        return self._broker

    def epoch(self) -> str:
        """The store's epoch, as this process read it lately."""
        cached = self._epoch
        if cached is None or time.monotonic() - cached[1] > EPOCH_REFRESH:
            cached = self._epoch = (store_epoch(self.ctl.store), time.monotonic())
        return cached[0]

    def kept(self, key: str, entry: str, us: int, message: bytes) -> None:
        """``entry`` joined the line of ``key`` at ``us`` with ``message``."""
        if self.enabled and entry and message:
            self._write(lambda: self.broker.kept(key, entry, us, message, self.epoch()),
                        f"task {entry} of the line of {key}")

    def gone(self, key: str, entries: Sequence[str], us: int, kind: Kind = Kind.GONE) -> None:
        """``entries`` left the line of ``key`` for good at ``us`` (``kind`` lost: the store
        reported their messages gone; the keeper sends them on from the journal)."""
        if self.enabled and entries:
            self._write(lambda: self.broker.gone([(key, entry, us) for entry in entries], kind),
                        f"{len(entries)} task(s) leaving the line of {key}")

    def _write(self, write: Any, what: str) -> None:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - the broker's any error: the line still holds the task
            self.ctl.metrics.store_error("journal")
            with self._lock:
                self._failures += 1
                now = time.monotonic()
                if now - self._reported_at < REPORT_EVERY:
                    return
                self._reported_at, failures, self._failures = now, self._failures, 0
            logger.warning("celery_throttle: could not write %s to the journal in the broker (%d failure(s) "
                           "since said): %r; the task(s) wait in the store alone", what, failures, exc)
