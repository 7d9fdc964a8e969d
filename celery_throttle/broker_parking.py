"""Long waits kept in RabbitMQ itself: a parked task as durable as the broker's messages.

With a RabbitMQ broker (``throttle_park_in = "auto"``, the default, or ``"broker"``) a
task whose wait is long is not stored in Redis, which may not keep it (a store without
persistence restarts empty; one that evicts drops it). It is published, persistent,
into kombu's native delayed delivery topology, declared under its own prefix
(``celery_throttle``; 28 durable classic queues of 2^n seconds, each dead-lettering into
the next), whose last level delivers it to its own queue at its due time. Its worker
then claims the start it reserved, as any re-sent task does.

A task a pause holds waits in one durable queue, ``<key prefix>.held``, until a
releaser finds its pause over (ended, resumed, or gone with a store that restarted
empty) and moves it to its own queue; a resume wakes a releaser at once.

The store keeps an index of them (task id, due time, what it is), for ``throttle why``
only: nothing depends on it. What it costs: such a task is not listed one by one by
``throttle parked --tasks`` (it is counted), and cannot be purged from the CLI.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from typing import TYPE_CHECKING, Any

from kombu.entity import Queue

try:  # kombu 5.5+ (Celery 5.5's native delayed delivery)
    from kombu.transport.native_delayed_delivery import (
        MAX_LEVEL,
        calculate_routing_key,
        declare_native_delayed_delivery_exchanges_and_queues,
        level_name,
    )
except ImportError:  # pragma: no cover - an older kombu: parked tasks stay in the store
    MAX_LEVEL = -1

from .controls import FOREVER_US
from .errors import StoreError
from .keys import state_of
from .protocol import HEADER, read_state, without_dead_letter_headers

if TYPE_CHECKING:
    from .limiter import Throttle

__all__ = ["DELAY_PREFIX", "DEST_HEADER", "BrokerParking", "broker_parking", "parks_in_broker"]

logger = logging.getLogger("celery_throttle")

#: The prefix of the delay topology's exchanges and queues (kombu's names after it).
DELAY_PREFIX = "celery_throttle"
#: Header naming the queue a held task goes back to.
DEST_HEADER = "celery_throttle_to"
#: The longest wait (seconds) the topology holds: 2^28 - 1 s, about 8.5 years.
MAX_DELAY = 2 ** (MAX_LEVEL + 1) - 1
#: The delay prefix calculate_routing_key puts before a routing key (one bit per level).
_DELAY_BITS = re.compile(rf"^(?:[01]\.){{{MAX_LEVEL + 1}}}")
#: Seconds before its due time a task parked in the topology is aimed to reach its queue
#: at least (the hops through its queues take some ms each; a task reaching its worker
#: after its start would give it up). A wait under a second more than this is sent with
#: its countdown instead.
ARRIVAL_SLACK = 0.5
#: Message properties a held task keeps when it is moved to its queue.
_MOVED_PROPERTIES = ("correlation_id", "reply_to", "priority", "delivery_mode", "app_id", "type", "message_id",
                     "timestamp")


def parks_in_broker(ctl: Throttle) -> bool:
    """Whether long waits go to RabbitMQ: ``throttle_park_in`` says so, or is ``auto``
    and the broker is an AMQP one."""
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


def broker_parking(ctl: Throttle) -> BrokerParking | None:
    """``ctl``'s broker parking, or None when it parks in the store (looked at once per
    process: a prefork child gets one of its own, not its parent's lock, which another
    thread of the parent may have held when it forked)."""
    current = ctl.broker_parking
    if current is None or (isinstance(current, BrokerParking) and current.pid != os.getpid()):
        ctl.broker_parking = BrokerParking(ctl) if parks_in_broker(ctl) else False
    return ctl.broker_parking or None


class BrokerParking:
    """Publishes parked tasks into the delay topology or the held queue, and moves held
    tasks back when their pause is over."""

    def __init__(self, ctl: Throttle) -> None:
        self.ctl = ctl
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._declared = False
        self._bound: set[str] = set()

    @property
    def held_queue(self) -> str:
        return f"{self.ctl.settings.key_prefix}.held"

    def park(self, sig: Any, due_us: int, now_us: int, held: bool) -> None:
        """Publish ``sig`` to arrive in its queue at ``due_us`` (Redis clock; ``now_us``
        its now), or,
        if a pause ``held`` it, to the held queue. Noted in the store's index for
        ``throttle why`` (if the store answers). Raises what the broker raises (the
        caller parks it in the store instead)."""
        self._publish(sig, (due_us - now_us) / 1e6, held)
        task_id = sig.options.get("task_id")
        if task_id:
            info = {"t": sig.task, "h": (sig.options.get("headers") or {}).get(HEADER), "held": held}
            try:
                self.ctl.parking.index_in_broker(str(task_id), FOREVER_US if held else due_us, json.dumps(info))
            except StoreError as exc:  # only `why` misses it
                logger.debug("could not note %s as parked in the broker: %s", task_id, exc)

    def _publish(self, sig: Any, delay: float, held: bool) -> None:
        dest = self.destination(sig.options)
        if dest is None:
            raise ValueError(f"no queue to send {sig.task} back to after its wait (options {sig.options!r})")
        moved = sig.clone()
        for option in ("queue", "exchange", "routing_key", "exchange_type", "countdown", "eta"):
            moved.options.pop(option, None)
        if held:
            moved.options["headers"] = {**(moved.options.get("headers") or {}), DEST_HEADER: dest}
            self._prepare(dest=None)
            moved.apply_async(queue=self._held(), exchange_type="direct")
            return
        if delay < 1 + ARRIVAL_SLACK:  # (the topology's least delay is a second)
            moved.apply_async(countdown=max(delay, 0.0), queue=dest)
            return
        self._prepare(dest)
        # The topology counts whole seconds, and its hops take a little: the task is
        # aimed ARRIVAL_SLACK early, and its ETA (the countdown) holds it in the worker's
        # timer for the rest.
        seconds = min(math.floor(delay - ARRIVAL_SLACK), MAX_DELAY)
        moved.apply_async(exchange=level_name(MAX_LEVEL, DELAY_PREFIX), exchange_type="topic",
                          routing_key=calculate_routing_key(seconds, dest), countdown=max(delay, 0.0))

    def destination(self, options: dict[str, Any]) -> str | None:
        """The name of the queue a message sent with ``options`` went to (Celery's
        ``signature_from_request`` keeps the queue, or the exchange and routing key)."""
        queue = options.get("queue")
        if queue is not None:
            return queue if isinstance(queue, str) else str(queue.name)
        exchange, routing_key = options.get("exchange") or "", options.get("routing_key")
        exchange = exchange if isinstance(exchange, str) else str(exchange.name)
        if not routing_key:
            return str(self.ctl.app.conf.task_default_queue)
        if exchange.startswith(f"{DELAY_PREFIX}_"):  # it came through the delay topology
            routing_key, exchange = _DELAY_BITS.sub("", routing_key, count=1), ""
        for known in self.ctl.app.amqp.queues.values():
            if known.exchange is not None and known.exchange.name == exchange and known.routing_key == routing_key:
                return str(known.name)
        if exchange in ("", routing_key):  # the default exchange, or Celery's queue-named one
            return str(routing_key)
        return None

    def _held(self) -> Queue:
        return Queue(self.held_queue, routing_key=self.held_queue, durable=True)

    def _prepare(self, dest: str | None) -> None:
        """Declare the topology and the held queue, and bind ``dest`` to the topology's
        delivery exchange, once per process."""
        if self._declared and (dest is None or dest in self._bound):
            return
        with self._lock, self.ctl.app.connection_for_write() as conn:
            if not self._declared:
                declare_native_delayed_delivery_exchanges_and_queues(conn, "classic", prefix=DELAY_PREFIX)
                self._held().bind(conn.default_channel).declare()
                self._declared = True
            if dest is not None and dest not in self._bound:
                conn.default_channel.queue_bind(queue=dest, exchange=f"{DELAY_PREFIX}_celery_delayed_delivery",
                                                routing_key=f"#.{dest}")
                self._bound.add(dest)

    def move_held(self) -> tuple[int, int]:
        """Move every held task whose pause is over to its queue; the others go to the
        back of the held queue. Each message is taken once (as many as the queue held at
        the start). Returns (moved, still held)."""
        self._prepare(dest=None)
        ctl = self.ctl
        ctl.checker.refresh_controls()
        now_us = ctl.store.now_us()
        moved = kept = 0
        gone: list[str] = []
        with ctl.app.connection_for_write() as conn:
            channel = conn.default_channel
            queue = self._held().bind(channel)
            _, count, _ = queue.queue_declare(passive=True)
            producer = conn.Producer(channel)
            for _ in range(count):
                message = queue.get(no_ack=False)
                if message is None:
                    break
                headers = without_dead_letter_headers(message.headers)
                dest = headers.get(DEST_HEADER)
                held = self._still_held(headers, now_us) or not isinstance(dest, str)
                properties = {name: message.properties[name] for name in _MOVED_PROPERTIES
                              if message.properties.get(name) is not None}
                producer.publish(message.body, exchange="", routing_key=self.held_queue if held else dest,
                                 headers=headers, content_type=message.content_type,
                                 content_encoding=message.content_encoding, **properties)
                message.ack()
                kept, moved = kept + held, moved + (not held)
                if not held and isinstance(headers.get("id"), str):
                    gone.append(headers["id"])
        if gone:
            try:
                ctl.parking.forget_in_broker(gone)
            except StoreError as exc:
                logger.debug("could not forget %d moved task(s) in the index: %s", len(gone), exc)
        if moved:
            logger.info("moved %d task(s) held by a pause that is over back to their queue", moved)
        return moved, kept

    def _still_held(self, headers: dict[str, Any], now_us: int) -> bool:
        state = read_state(headers.get(HEADER))
        named = state_of(self.ctl.settings.key_prefix, state["k"]) if "k" in state else None
        return named is not None and self.ctl.checker.pause_end_of(*named) > now_us

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
