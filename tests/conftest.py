"""Fixtures: a real Redis, real worker subprocesses, and clean-up of every key written.

A missing Redis skips the tests locally but fails them in CI (CI=true).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from hypothesis import settings

# No per-example deadline: these machines are shared, and a slow example is not a wrong one.
settings.register_profile("celery_throttle", deadline=None)
settings.load_profile("celery_throttle")

from tests.helpers import BROKER_URL, STORE_URL, WorkerGroup, delete_queues, rabbitmq_or_skip, redis_or_skip

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture(scope="session")
def store_client() -> redis.Redis:
    return redis_or_skip(STORE_URL)


def _clean(client: redis.Redis, prefix: str) -> None:
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        client.delete(key)


@pytest.fixture
def prefix(store_client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    value = f"ct-test-{uuid.uuid4().hex[:10]}"
    yield value
    _clean(store_client, value)


@pytest.fixture(scope="session", params=["redis", "rabbitmq"], ids=["redis-broker", "rabbitmq-broker"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """The behaviour suite runs with Redis as broker and with RabbitMQ (the store is Redis)."""
    if request.param == "redis":
        return BROKER_URL
    return rabbitmq_or_skip(RABBITMQ_URL)


@pytest.fixture(scope="session")
def workers(store_client: redis.Redis, broker_url: str) -> Iterator[WorkerGroup]:
    """Two worker processes, two pool processes each, shared by the behaviour tests.

    Tests keep out of each other's way with scopes, keys and labels of their own.
    """
    prefix = f"ct-test-{uuid.uuid4().hex[:10]}"
    group = WorkerGroup(prefix=prefix, broker=broker_url, store=STORE_URL, count=2,
                        concurrency=2, env={"CT_PARK_AFTER": "3"})
    group.start()
    yield group
    group.stop()
    _clean(store_client, prefix)
    delete_queues(broker_url, group.queues)

