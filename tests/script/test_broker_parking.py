"""What an earlier version's pause held in RabbitMQ (waits/broker_parking.py), on a real
RabbitMQ: each held task goes back to the queue it names, once, with its headers and
properties but without the dead-letter history RabbitMQ wrote on it, and ``counts`` says
what is left (what ``throttle parked`` shows). Messages are written as those versions
wrote them (a durable ``<prefix>.held`` queue, the destination in a header).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from kombu.connection import Connection
from kombu.entity import Queue

from celery_throttle.check.limiter import Throttle
from celery_throttle.waits.broker_parking import DEST_HEADER, BrokerParking
from tests.conftest import RABBITMQ_URL
from tests.helpers import STORE_URL, delete_queues, rabbitmq_or_skip


@pytest.fixture
def parking(prefix: str) -> Iterator[tuple[BrokerParking, str]]:
    broker = rabbitmq_or_skip(RABBITMQ_URL)
    app = Celery("broker-parking", broker=broker, set_as_current=False)
    app.conf.task_default_queue = f"{prefix}-default"
    ctl = Throttle(app, {"redis_url": STORE_URL, "key_prefix": prefix})
    try:
        yield BrokerParking(ctl), broker
    finally:
        delete_queues(broker, [f"{prefix}.held", f"{prefix}-q", f"{prefix}-default"])
        ctl.close()


def drain(broker: str, name: str) -> list[tuple[bytes, dict, dict]]:
    with Connection(broker) as conn:
        queue = Queue(name, routing_key=name, durable=True).bind(conn.default_channel)
        queue.declare()
        got = []
        while (message := queue.get(no_ack=True)) is not None:
            body = message.body.encode() if isinstance(message.body, str) else message.body
            got.append((body, dict(message.headers), dict(message.properties)))
        return got


def test_held_tasks_go_back_to_their_queue_once(parking: tuple[BrokerParking, str], prefix: str) -> None:
    park, broker = parking
    assert park.move_held() == 0  # (never declared: nothing was held)
    with Connection(broker) as conn:
        channel = conn.default_channel
        held = Queue(park.held_queue, routing_key=park.held_queue, durable=True).bind(channel)
        held.declare()
        Queue(f"{prefix}-q", routing_key=f"{prefix}-q", durable=True).bind(channel).declare()
        producer = conn.Producer(channel)
        for i in range(3):
            producer.publish(f"task {i}".encode(), exchange="", routing_key=park.held_queue,
                             headers={"id": f"t{i}", DEST_HEADER: f"{prefix}-q", "x-death": [{"count": 1}],
                                      "x-first-death-queue": "somewhere"},
                             correlation_id=f"t{i}", priority=3, content_type="application/json",
                             content_encoding="utf-8", serializer=None)
        producer.publish(b"no destination", exchange="", routing_key=park.held_queue, headers={"id": "t9"},
                         content_type="application/json", content_encoding="utf-8", serializer=None)
    assert park.counts() == (0, 4)
    # (the app's default queue has not been declared yet: RabbitMQ would drop what is sent to it)
    assert park.move_held() == 3 and park.counts() == (0, 1)
    with Connection(broker) as conn:
        Queue(f"{prefix}-default", routing_key=f"{prefix}-default", durable=True).bind(conn.default_channel).declare()
    assert park.move_held() == 1
    assert park.move_held() == 0 and park.counts() == (0, 0)
    back = drain(broker, f"{prefix}-q")
    assert sorted(body for body, _, _ in back) == [b"task 0", b"task 1", b"task 2"]
    for body, headers, properties in back:
        n = body.decode().split()[-1]
        assert headers == {"id": f"t{n}"}  # (no destination, no dead-letter history)
        assert properties["correlation_id"] == f"t{n}" and properties["priority"] == 3
    assert [(body, headers) for body, headers, _ in drain(broker, f"{prefix}-default")] == \
        [(b"no destination", {"id": "t9"})]  # (the app's default queue)


def test_counts_without_any_parking_is_zero_and_declares_nothing(parking: tuple[BrokerParking, str]) -> None:
    park, broker = parking
    assert park.counts() == (0, 0)
    with Connection(broker) as conn, pytest.raises(Exception, match="NOT_FOUND"):
        Queue(park.held_queue).bind(conn.default_channel).queue_declare(passive=True)
