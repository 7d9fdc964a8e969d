"""Tasks an earlier version parked in RabbitMQ, sent on after an upgrade.

Earlier versions (header formats 1 and 2), with a RabbitMQ broker, parked a task whose
wait was long in kombu's native delayed delivery topology (under the prefix
``celery_throttle``): those deliver themselves to their queue when due, and the worker
that gets one checks it as a new task. A task a pause held waited in the durable queue
``<key prefix>.held``: every worker's releaser moves each one back to its queue
(:meth:`BrokerParking.move_held`), where it is checked as a new task (a pause still in
force keeps it in its key's line now). ``throttle parked`` counts both.
"""

from __future__ import annotations

import logging
import os
import weakref
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from kombu.entity import Queue

try:  # kombu 5.5+ (Celery 5.5's native delayed delivery)
    from kombu.transport.native_delayed_delivery import MAX_LEVEL, level_name
except ImportError:  # pragma: no cover - an older kombu: nothing was parked there
    MAX_LEVEL = -1

from ..core.header import without_dead_letter_headers
from ..core.locks import ForkSafeLock

if TYPE_CHECKING:
    from ..check.parts import Parts

__all__ = ["DELAY_PREFIX", "DEST_HEADER", "BrokerParking", "broker_parking", "parks_in_broker"]

logger = logging.getLogger("celery_throttle")

#: The prefix of the delay topology's exchanges and queues (kombu's names after it).
DELAY_PREFIX = "celery_throttle"
#: Header naming the queue a held task goes back to.
DEST_HEADER = "celery_throttle_to"
#: Message properties a held task keeps when it is moved to its queue.
_MOVED_PROPERTIES = ("correlation_id", "reply_to", "priority", "delivery_mode", "app_id", "type", "message_id",
                     "timestamp")


def parks_in_broker(ctl: Parts) -> bool:
    """Whether an earlier version parked long waits in RabbitMQ: ``throttle_park_in`` says
    so, or is ``auto`` and the broker is an AMQP one."""
    where = ctl.settings.park_in
    if MAX_LEVEL < 0:  # (kombu without the delay topology)
        if where == "broker":
            logger.warning("celery_throttle: throttle_park_in is 'broker', but this kombu has no native "
                           "delayed delivery (kombu 5.5+): parked tasks are kept in the store")
        return False
    if where != "auto":
        return where == "broker"
    try:
        return bool(ctl.app.connection_for_write().transport.driver_type == "amqp")
    except Exception:  # noqa: BLE001 - a broker URL we cannot read parks in the store
        return False


#: Where each app's long waits went in the broker, as looked at under its settings, in this
#: process: (settings, pid, parking). Kept here, not on the controller: nothing else needs it.
_looked_at: weakref.WeakKeyDictionary[Any, tuple[Any, int, BrokerParking | None]] = weakref.WeakKeyDictionary()


def broker_parking(ctl: Parts) -> BrokerParking | None:
    """``ctl``'s broker parking, or None when nothing was parked in the broker (looked at
    once per process and settings: a prefork child gets one of its own, not its parent's
    lock, which another thread of the parent may have held when it forked; settings that
    change, ``install`` called again, look again)."""
    seen = _looked_at.get(ctl)
    if seen is None or seen[0] is not ctl.settings or seen[1] != os.getpid():
        seen = _looked_at[ctl] = (ctl.settings, os.getpid(), BrokerParking(ctl) if parks_in_broker(ctl) else None)
    return seen[2]


def _declared(conn: Any, name: str) -> bool:
    """Whether the queue ``name`` exists (asked on a channel of its own: RabbitMQ closes the
    channel that asks for a queue it does not have)."""
    channel = conn.channel()
    try:
        Queue(name).bind(channel).queue_declare(passive=True)
        return True
    except Exception:  # noqa: BLE001 - NOT_FOUND
        return False
    finally:
        with suppress(Exception):
            channel.close()


class BrokerParking:
    """What earlier versions parked in RabbitMQ: counted, and the held sent on."""

    def __init__(self, ctl: Parts) -> None:
        # (Weakly: broker_parking() keeps this by its controller, which a strong reference
        # here would keep alive for ever.)
        self._ctl = weakref.ref(ctl)
        self._lock = ForkSafeLock()

    @property
    def ctl(self) -> Parts:
        ctl = self._ctl()
        if ctl is None:
            raise ReferenceError("the throttle of this broker parking's app is gone")
        return ctl

    @property
    def held_queue(self) -> str:
        return f"{self.ctl.settings.key_prefix}.held"

    def _held(self) -> Queue:
        return Queue(self.held_queue, routing_key=self.held_queue, durable=True)


    def move_held(self) -> int:
        """Move every task an earlier version's pause held back to its queue (a pause in
        force now keeps it in its key's line). Each message is taken once (as many as the
        queue held at the start). Returns how many were moved."""
        ctl = self.ctl
        moved = 0
        with self._lock, ctl.app.connection_for_write() as conn:
            channel = conn.default_channel
            queue = self._held().bind(channel)
            try:
                _, count, _ = queue.queue_declare(passive=True)
            except Exception:  # noqa: BLE001 - never declared: nothing was held
                return 0
            producer = conn.Producer(channel)
            exists: dict[str, bool] = {}
            kept: list[Any] = []
            for _ in range(count):
                message = queue.get(no_ack=False)
                if message is None:
                    break
                headers = without_dead_letter_headers(message.headers)
                dest = headers.pop(DEST_HEADER, None)
                dest = dest if isinstance(dest, str) else str(ctl.app.conf.task_default_queue)
                if dest not in exists:
                    exists[dest] = _declared(conn, dest)
                if not exists[dest]:
                    kept.append(message)  # (RabbitMQ drops what goes to no queue: it waits for its worker)
                    continue
                properties = {name: message.properties[name] for name in _MOVED_PROPERTIES
                              if message.properties.get(name) is not None}
                producer.publish(message.body, exchange="", routing_key=dest, headers=headers,
                                 content_type=message.content_type, content_encoding=message.content_encoding,
                                 **properties)
                message.ack()
                moved += 1
            for message in kept:
                message.requeue()
        if moved:
            logger.info("moved %d task(s) an earlier version's pause held back to their queue", moved)
        if kept:
            logger.warning("celery_throttle: %d task(s) an earlier version's pause held stay in %s: their queue "
                           "(%s) does not exist yet; they move once a worker has declared it", len(kept),
                           self.held_queue, ", ".join(sorted(d for d, ok in exists.items() if not ok)))
        return moved

    def counts(self) -> tuple[int, int]:
        """(tasks in the delay queues, tasks held by a pause) in the broker now."""
        counts = []
        with self.ctl.app.connection_for_write() as conn:
            channel = conn.default_channel
            for name in (*(level_name(level, DELAY_PREFIX) for level in range(MAX_LEVEL + 1)), self.held_queue):
                try:
                    counts.append(int(Queue(name).bind(channel).queue_declare(passive=True)[1]))
                except Exception:  # noqa: BLE001 - not declared yet: nothing in it
                    counts.append(0)
                    channel = conn.channel()  # (RabbitMQ closes a channel on an unknown queue)
        return sum(counts[:-1]), counts[-1]
