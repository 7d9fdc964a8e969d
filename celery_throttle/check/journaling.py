"""This process's writes to the journal (:mod:`celery_throttle.core.journal`): a task that
joins a line is ``kept`` there, one that leaves it for good is ``gone``.

On by default (``throttle_journal``, None: by the broker) wherever the store could fail
apart from the broker: RabbitMQ, any other transport, a Redis broker on another server or
another database of one server. A task that waits then survives whatever the broker
survives, though the store be a cache (no persistence, an eviction policy, a Sentinel
group that fails over). Off only where the store *is* the broker's own Redis database:
the line and the queue fail together there, as plain Celery's queue would, and a copy in
that database would be lost with the line (the worker's start line says so;
``throttle_journal = True`` writes one all the same).

A write that fails (the broker unreachable, the queue refusing it) is logged and counted,
and never raises. A ``kept`` that fails says so to its caller, which must not leave the
task in the store alone: the task's own message goes to the broker instead, naming the
entry it holds in its line (a copy that arrives while that entry waits is told it waits
there; one that arrives after it ran is dropped). A ``gone`` that fails costs at most a
task sent on twice by the keeper, never one lost.

Each ``kept`` event names the store's epoch (``core/journal.py``): read by this process at
most every EPOCH_REFRESH seconds, and made by the first writer that finds none (a store
that restarted empty).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from ..celery_parts.journal_queue import BrokerJournal
from ..core.errors import StoreError
from ..core.journal import Kind
from ..core.locks import ForkSafeLock

if TYPE_CHECKING:

    from .setup import Setup

__all__ = ["Journaling", "journal_on", "redis_database", "store_is_broker_db"]

logger = logging.getLogger("celery_throttle")

#: URL schemes of one Redis server (or Sentinel group) and its database, as a broker or a
#: store names it.
_REDIS_SCHEMES = ("redis", "rediss", "unix", "socket", "sentinel", "redis+sentinel", "rediss+sentinel")
#: Host names that are this machine, as one.
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "")
#: A failing journal is said again at most this often (seconds) by one process.
REPORT_EVERY = 60.0
#: How long (seconds) a process trusts the epoch it read. A task kept in the second after a
#: store restarted empty may name the epoch before: harmless, as the keeper sends on only a
#: task the store does not hold, and the new store holds it.
EPOCH_REFRESH = 1.0


def redis_database(url: Any) -> tuple[str, frozenset[str], int] | None:
    """(kind, its servers, database) of a Redis URL, a ``;``-separated list of them (a
    broker's failover list, a Sentinel group) as one; None for any other URL. Servers
    are ``host:port`` (this machine's names as one) or a socket's path."""
    if isinstance(url, (list, tuple)):
        url = ";".join(str(part) for part in url)
    if not isinstance(url, str) or not url:
        return None
    kinds, servers, dbs = set(), set(), set()
    for part in filter(None, (p.strip() for p in url.split(";"))):
        parsed = urlsplit(part)
        scheme = parsed.scheme.lower()
        if scheme not in _REDIS_SCHEMES:
            return None
        kinds.add("sentinel" if "sentinel" in scheme else "socket" if scheme in ("unix", "socket") else "redis")
        query = parse_qs(parsed.query)
        try:
            db = int((query.get("db") or query.get("virtual_host") or [parsed.path.strip("/") or "0"])[0])
            port = parsed.port
        except ValueError:
            return None
        if scheme in ("unix", "socket"):
            servers.add(parsed.path)
        else:
            host = (parsed.hostname or "").lower()
            servers.add(f"{'localhost' if host in _LOOPBACK else host}:{port or 6379}")
        dbs.add(db)
    if len(kinds) != 1 or len(dbs) != 1:
        return None
    return kinds.pop(), frozenset(servers), dbs.pop()


def store_is_broker_db(app: Any, store_url: str | None) -> bool:
    """Whether the store is ``app``'s broker's own Redis database (one server, or Sentinel
    group, and one database): the lines and the broker's queues fail together."""
    broker = redis_database(app.conf.broker_url)
    return broker is not None and broker == redis_database(store_url)


def journal_on(app: Any, setting: bool | None, store_url: str | None = None) -> bool:
    """Whether tasks waiting in lines are journaled in ``app``'s broker: ``setting``, or
    (None) wherever the store at ``store_url`` is not the broker's own Redis database."""
    if setting is not None:
        return setting
    return not store_is_broker_db(app, store_url)


class Journaling:
    """The journal of one app, as this process writes it."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self._broker: BrokerJournal | None = None
        self._enabled = False
        #: The settings ``_enabled`` and ``_broker`` were made for (install() again with
        #: other settings makes new ones).
        self._for: Any = None
        self._lock = ForkSafeLock()
        self._reported_at = float("-inf")
        self._failures = 0
        self._epoch: tuple[str, int, float] | None = None  # (epoch, made at: µs, when read: monotonic)

    @property
    def enabled(self) -> bool:
        settings = self.setup.settings
        if self._for is not settings:
            self._enabled = journal_on(self.setup.app, settings.journal, settings.redis_url)
            self._broker = BrokerJournal(self.setup.app, settings.key_prefix)
            self._for = settings
        return self._enabled

    @property
    def broker(self) -> BrokerJournal:
        """The journal's queue (whether or not it is on)."""
        _ = self.enabled
        assert self._broker is not None
        return self._broker

    def prime(self) -> None:
        """Read the store's epoch now, before this process's first call to the store that
        may put a task in a line (see :meth:`epoch`; a fork inherits it). Never raises."""
        if self._epoch is None and self.enabled:
            with suppress(StoreError):
                self._epoch = (*self.setup.store.journal_epoch(), time.monotonic())

    def epoch(self, us: int) -> str:
        """The store's epoch for a task that joined its line at ``us`` (the store's clock),
        as this process read it lately. An epoch made after the call (the store restarted
        empty between the call and this read) is not the one of the store the call went
        to: the task is named by the epoch read before (every process reads it before its
        first call: :meth:`prime`), or by none. (Named by the new epoch, the keeper would
        take it for one that left its line without a word, and drop it.) A read that fails
        (a reply lost on the link, while the call went through) names the epoch read
        last, or none. A ``kept`` event of no epoch is sent on by the keeper if the store
        does not know it: a task run twice in a double fault, rather than one lost."""
        cached = self._epoch
        if cached is None or time.monotonic() - cached[2] > EPOCH_REFRESH:
            try:
                fresh = self._epoch = (*self.setup.store.journal_epoch(), time.monotonic())
            except StoreError:
                return cached[0] if cached is not None else ""
            if fresh[1] > us:
                return cached[0] if cached is not None and cached[0] != fresh[0] else ""
            cached = fresh
        return cached[0]

    def kept(self, key: str, entry: str, us: int, message: bytes, producer: Any = None) -> bool:
        """``entry`` joined the line of ``key`` at ``us`` with ``message``, written with
        ``producer`` (the sender's, when it passed one; else one of the app's pool). False:
        its copy could not be written, and the caller sends the task's message to the broker."""
        if self.enabled and entry and message:
            return self._write(lambda: self.broker.kept(key, entry, us, message, self.epoch(us), producer),
                               f"task {entry} of the line of {key}", "its message is sent to the broker instead")
        return True

    def gone(self, key: str, entries: Sequence[str], us: int, kind: Kind = Kind.GONE, producer: Any = None) -> None:
        """``entries`` left the line of ``key`` for good at ``us`` (``kind`` lost: the store
        reported their messages gone; the keeper sends them on from the journal), written
        with ``producer`` (None: one of the app's pool)."""
        if self.enabled and entries:
            written = self._write(lambda: self.broker.gone([(key, entry, us) for entry in entries], kind, producer),
                                  f"{len(entries)} task(s) leaving the line of {key}",
                                  "the keeper may send on a task that left its line")
            if written and kind is Kind.LOST:
                # (Only a pass sends them on, and none may be due for minutes: one is
                # asked for now, from whichever worker's keeper looks next.)
                with suppress(StoreError):
                    self.setup.store.urge_journal_pass()

    def _write(self, write: Any, what: str, instead: str) -> bool:
        try:
            write()
            return True
        except Exception as exc:  # noqa: BLE001 - the broker's any error: the caller decides
            self.setup.metrics.store_error("journal")
            with self._lock:
                self._failures += 1
                now = time.monotonic()
                if now - self._reported_at < REPORT_EVERY:
                    return False
                self._reported_at, failures, self._failures = now, self._failures, 0
            logger.warning("celery_throttle: could not write %s to the journal in the broker (%d failure(s) "
                           "since said): %r; %s", what, failures, exc, instead)
            return False
