"""The journal in the broker: one durable queue per app (per key prefix) holding a copy of
every task waiting in a line, as the events of :mod:`celery_throttle.core.journal`.

Written by whoever puts a task in a line or takes one out (a producer at publish, a
worker's consumer or pool, a releaser), through the app's own producer pool: a ``kept``
event is published before the task's own message is acked (or, at publish, instead of
sending it), persistent, to a durable queue, so the broker keeps it as durably as it
would have kept the task in its queue. Read only by the keeper
(:mod:`celery_throttle.waits.keeper`), on a connection of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.messaging import Producer

from ..core.journal import CONTENT_TYPE, GONE_BATCH, Kind, entries_message, kept_headers

__all__ = ["BrokerJournal", "journal_queue_name"]

#: How a journal publish retries a broker connection that broke (kombu's retry policy):
#: briefly, as the task's own send would; a journal that cannot be written is logged by
#: the caller, and the task still waits in its line.
_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2, "interval_max": 0.5}


def journal_queue_name(prefix: str) -> str:
    """The journal's queue for the throttle of key prefix ``prefix``."""
    return f"celery_throttle.journal.{prefix}"


class BrokerJournal:
    """The journal queue of one app."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app = app
        self.name = journal_queue_name(prefix)
        # (A classic queue, whatever the vhost's default: a quorum queue's delivery limit
        # would drop a message that passes which died had read too many times.)
        self.queue = Queue(self.name, Exchange(""), routing_key=self.name, durable=True, auto_delete=False,
                           queue_arguments={"x-queue-type": "classic"})
        #: how kombu names the queue in a connection's cache of what it declared
        self._ident = hash(self.queue)

    # -- writing (any process) ----------------------------------------------------------
    def kept(self, key: str, entry: str, us: int, message: bytes, epoch: str, producer: Producer | None = None) -> None:
        """``entry`` joined the line of state key ``key`` at ``us`` (the store's clock, in
        its ``epoch``) with ``message``, by ``producer`` (None: one of the app's pool).
        Raises the broker's error."""
        self._publish(kept_headers(key, entry, us, epoch=epoch), message, producer)

    def gone(self, events: Sequence[tuple[str, str, int]], kind: Kind = Kind.GONE,
             producer: Producer | None = None) -> None:
        """These entries (key, entry, us) left their lines for good (``kind`` lost: the
        store lost their messages), by ``producer`` (None: one of the app's pool). Raises
        the broker's error."""
        for start in range(0, len(events), GONE_BATCH):
            headers, body = entries_message(kind, events[start:start + GONE_BATCH])
            self._publish(headers, body, producer)

    def _publish(self, headers: dict[str, Any], body: bytes, given: Producer | None = None) -> None:
        with self.app.producer_or_acquire(given) as producer:
            self.publish(producer, headers, body, declare=True)

    def publish(self, producer: Producer, headers: dict[str, Any], body: bytes, declare: bool = False) -> None:
        """Publish one journal message with ``producer`` (persistent, to the durable queue),
        declaring the queue first (``declare``) unless its connection declared it already."""
        # (kombu declares an entity once per connection, but binds a copy of it to the
        # channel on every publish that names it before it looks: a fifth of a producer's
        # time per task kept at publish. Its own cache, looked at first, spares the copy.)
        declared = getattr(producer.connection, "declared_entities", None)
        if declare and declared is not None and self._ident in declared:
            declare = False
        producer.publish(body, exchange="", routing_key=self.name, declare=[self.queue] if declare else [],
                         headers=headers, delivery_mode=2, content_type=CONTENT_TYPE, content_encoding="binary",
                         serializer=None, retry=True, retry_policy=_RETRY_POLICY)

    # -- reading (the keeper) -----------------------------------------------------------
    def connect(self) -> Connection:
        """A connection of the keeper's own to the broker."""
        return self.app.connection_for_read()

    def length(self, connection: Connection) -> int:
        """How many messages the journal holds (declaring it if it does not exist)."""
        _, count, _ = self.queue(connection.default_channel).queue_declare()
        return int(count or 0)

    def restore_strays(self, connection: Connection) -> int:
        """Put back in the journal every message of it that a reader took and never acked
        (its worker was SIGKILLed mid-pass, its connection broke): called under the
        keeper's lock, when no other pass reads. RabbitMQ gives such messages back when
        the reader's connection closes; a Redis broker sets them aside until its
        visibility timeout (an hour by default), and the copies of the waiting tasks with
        them: a store lost meanwhile would lose those tasks. Returns how many."""
        channel: Any = connection.default_channel  # (kombu's Redis channel, or any other)
        restore = getattr(getattr(channel, "qos", None), "restore_by_tag", None)
        key = getattr(channel, "unacked_key", None)
        if restore is None or not isinstance(key, str):
            return 0
        name, strays = self.name.encode(), []
        with channel.conn_or_acquire() as client:
            for tag, raw in client.hscan_iter(key, count=1000):
                if name not in raw:
                    continue  # (most are the tasks workers hold: not parsed)
                try:
                    _, exchange, routing_key = json.loads(raw)
                except (ValueError, TypeError):
                    continue
                if routing_key == self.name and not exchange:
                    strays.append(tag)
        for tag in strays:
            restore(tag)
        return len(strays)

    def take(self, connection: Connection, most: int) -> Iterator[Any]:
        """Up to ``most`` messages from the journal's head, each unacked until the caller
        acks it (a keeper that dies leaves them to the broker, which gives them back)."""
        bound = self.queue(connection.default_channel)
        for _ in range(most):
            message = bound.get(no_ack=False, accept=[CONTENT_TYPE])
            if message is None:
                return
            yield message
