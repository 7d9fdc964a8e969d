"""The hand-off: a task released because a body ended goes to that body's own worker.

A slot that frees frees a pool process in the worker whose body ended. Sent to the task's
queue on a Redis broker, the task released into that slot is taken by whichever worker
pops it first, and with Celery's default prefetch a worker whose processes are all busy
still pops: the task then waits in its buffer while the slot it holds and the process
that freed sit idle elsewhere (a tenant alone, 2 workers x 3: 0.95 of the slots while it
floods). So each worker consumes a list of its own, and the process whose body ended
sends the first task its end released there (0.98). RabbitMQ already gives a released
task to a worker with room (0.98 without this): nothing is handed there.

A worker's releaser (its main process) hands the first task a release of its frees to
its own worker too, when that worker has a process idle and the key has a concurrency
limit: a slot the sharer moved to another key goes where a process waits for it.

Only where that worker would take the task from its own queues too: the task is known to
it, the queue its routes send it to is one the worker consumes, and it is acked as it
starts (Celery's default: one acked late and killed mid-body is given back to the queue
it came from, which no other worker consumes). A handed task that would wait in its
worker for a process (the worker took more than it has: a task sent to the common queue
before) is handed back: it goes back to its place and is released again to the common
queue.

Nothing handed is lost with its worker. The send is not acked to the store
(:meth:`.Lines.handle`): one that does not start within the send lease (its worker died
with it) is put back in its place by the store and released again to any worker; the copy
left behind finds its ticket used if it ever comes, and is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kombu.entity import Exchange, Queue

__all__ = ["Hand", "hand_queue"]

#: Transports whose workers take a hand-off (kombu's driver types): those where a busy
#: worker takes a task sent to the common queue.
_HANDING_TRANSPORTS = ("redis",)


def hand_queue(hostname: str) -> Queue:
    """The queue worker ``hostname`` takes hand-offs from: a list sent to by its name,
    never declared (no binding is written for it: nothing is left of it in the broker once
    its worker has taken what was sent there)."""
    name = f"{hostname}.throttle-hand"
    return Queue(name, Exchange("", type="direct"), routing_key=name, no_declare=True)


class Hand:
    """This worker's hand-off queue, and which tasks may take it (made in the worker
    before its pool forks; a producer has none)."""

    def __init__(self) -> None:
        self.queue: Queue | None = None
        self._consumed: frozenset[str] = frozenset()
        #: Whether this worker has a pool process idle now (set by the worker once its
        #: consumer exists): its releaser hands a task it releases to it then.
        self.idle: Callable[[], bool] = lambda: False

    def open(self, app: Any, hostname: str, setting: bool = True) -> bool:
        """Consume this worker's own queue from its start (the worker's queues are chosen,
        its consumer not yet started). ``setting``: ``throttle_hand_off``. False: not here
        (off, or a broker that needs none; nothing changes)."""
        with app.connection_for_read() as connection:
            kind = connection.transport.driver_type
        if not setting or kind not in _HANDING_TRANSPORTS:
            return False
        queues = app.amqp.queues
        self._consumed = frozenset(queues.consume_from or queues)
        self.queue = hand_queue(hostname)
        queues.select_add(self.queue)
        return True

    def takes(self, app: Any, name: str, args: Any, kwargs: Any, options: dict[str, Any]) -> bool:
        """Whether this worker would take task ``name`` sent with ``options`` from its own
        queues: it knows the task, acks it as it starts, and its routes send it to a
        queue the worker consumes."""
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
        """Whether ``request`` (or a message) came through this worker's own queue."""
        info = getattr(request, "delivery_info", None) or {}
        return self.queue is not None and info.get("routing_key") == self.queue.name
