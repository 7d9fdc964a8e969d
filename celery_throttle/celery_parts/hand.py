"""The hand-off: a task released because a body ended goes to that body's own worker.

A slot that frees frees a pool process in the worker whose body ended. Sent to the task's
queue, the task released into that slot is taken by whichever worker fetches first, and
with Celery's default prefetch a worker whose processes are all busy still fetches: the
task then waits in its buffer while the slot it holds and the process that freed sit
idle elsewhere (a tenant alone used 0.88 of its slots on 2 workers). So each worker
consumes a queue of its own, and the process whose body ended sends the first task its
end released there.

Only where that worker would take the task from its own queue too: the task is known to
it, the queue its routes send it to is one the worker consumes, the task is acked as it
starts (Celery's default: one acked late and killed mid-body is given back to the queue it
came from, which no other worker consumes), and the transport is Redis or AMQP (a direct
send by the queue's name). A handed task that would wait in its worker for a process (the
worker took more than it has: a task sent to the common queue before) is handed back: it
goes back to its place and is released again to the common queue. The send is not acked to the store
(:meth:`.Lines.handle`): if it does not arrive within the send lease (its worker died
with it, and its queue has no other consumer), the store puts it back in its place, and
it is released again to any worker; the copy left in the dead worker's queue finds its
ticket used when it comes, and is dropped. An AMQP queue of a worker that never comes
back is deleted by the broker after HAND_QUEUE_EXPIRES_MS unused.
"""

from __future__ import annotations

from typing import Any

from kombu.entity import Exchange, Queue

__all__ = ["HAND_QUEUE_EXPIRES_MS", "Hand", "hand_queue"]

#: An AMQP worker queue unused this long (ms) is deleted by the broker: its worker is gone
#: (renamed, scaled down), and whatever was sent to it went back in its line long since.
HAND_QUEUE_EXPIRES_MS = 24 * 3600 * 1000
#: Transports whose default exchange delivers to a queue by its name (kombu's driver types).
_DIRECT_TRANSPORTS = ("redis", "amqp")


def hand_queue(hostname: str) -> Queue:
    """The queue worker ``hostname`` takes hand-offs from (one object for its declaration
    by the worker and by a sender: RabbitMQ refuses a second with other arguments)."""
    name = f"{hostname}.throttle-hand"
    return Queue(name, Exchange("", type="direct"), routing_key=name, durable=True,
                 queue_arguments={"x-expires": HAND_QUEUE_EXPIRES_MS})


class Hand:
    """This worker's hand-off queue, and which tasks may take it (made in the worker
    before its pool forks; a producer has none)."""

    def __init__(self) -> None:
        self.queue: Queue | None = None
        self._consumed: frozenset[str] = frozenset()

    def open(self, app: Any, hostname: str) -> bool:
        """Consume this worker's own queue from its start (the worker's queues are chosen,
        its consumer not yet started). False: a transport that cannot (nothing changes)."""
        with app.connection_for_read() as connection:
            if connection.transport.driver_type not in _DIRECT_TRANSPORTS:
                return False
        queues = app.amqp.queues
        self._consumed = frozenset(queues.consume_from or queues)
        self.queue = hand_queue(hostname)
        queues.select_add(self.queue)
        return True

    def takes(self, app: Any, name: str, args: Any, kwargs: Any, options: dict[str, Any]) -> bool:
        """Whether this worker would take task ``name`` sent with ``options`` from its own
        queues: it knows the task, its routes send it to a queue the worker consumes, and
        it acks the task as it starts (Celery's default). A task acked late goes to its
        common queue: killed mid-body, the broker gives it back to the queue it came from,
        and a dead worker's own queue has no other consumer."""
        task = app.tasks.get(name) if self.queue is not None else None
        if task is None or getattr(task, "acks_late", False):
            return False
        try:
            route = app.amqp.router.route(dict(options), name, args, kwargs)
        except Exception:  # noqa: BLE001 - a route that fails here is the broker's to send
            return False
        queue = route.get("queue")
        return getattr(queue, "name", queue) in self._consumed

    def delivered(self, request: Any) -> bool:
        """Whether ``request`` came through this worker's own queue."""
        info = getattr(request, "delivery_info", None) or {}
        return self.queue is not None and info.get("routing_key") == self.queue.name
