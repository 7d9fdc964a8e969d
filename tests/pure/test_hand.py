"""Which tasks a worker takes from its own queue (celery_parts/hand.py): only one it knows,
acked as it starts, whose routes send it to a queue the worker consumes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_throttle.celery_parts.hand import (
    Hand,
    hand_queue,
)


@pytest.fixture
def routed_app() -> Iterator[Celery]:
    app = Celery(f"hand-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue="main", task_routes={"hand.elsewhere": {"queue": "gpu"}})

    @app.task(name="hand.here", shared=False)
    def here() -> None: ...

    @app.task(name="hand.elsewhere", shared=False)
    def elsewhere() -> None: ...

    @app.task(name="hand.late", shared=False, acks_late=True)
    def late() -> None: ...

    yield app
    app.close()


def test_a_worker_takes_only_what_it_would_take_from_its_own_queues(routed_app: Celery) -> None:
    app = routed_app
    hand = Hand()
    assert not hand.takes(app, "hand.here", (), {}, {})  # (no queue of its own: a producer)
    assert not hand.open(app, "w1@host")  # (a broker that needs no hand-off: here, memory)
    hand.queue, hand._consumed = hand_queue("w1@host"), frozenset({"main", "extra"})
    assert hand.takes(app, "hand.here", (), {}, {})
    assert hand.takes(app, "hand.here", (), {}, {"queue": "extra"})
    assert not hand.takes(app, "hand.here", (), {}, {"queue": "other"})  # (a queue it does not consume)
    assert not hand.takes(app, "hand.elsewhere", (), {}, {})  # (its routes say gpu)
    assert not hand.takes(app, "hand.late", (), {}, {})  # (acked late: a dead worker's queue would keep it)
    assert not hand.takes(app, "hand.unknown", (), {}, {})


def test_the_queue_is_one_per_worker() -> None:
    queue = hand_queue("w1@host")
    assert queue.name == queue.routing_key == "w1@host.throttle-hand"
    assert queue.exchange.name == "" and queue.no_declare  # (sent to by its name; no binding left behind)
    assert hand_queue("w2@host").name != queue.name
