"""The example of testing throttled tasks in docs/operations.md (Celery's own pytest fixtures, with an
in-process worker): kept here so that the suite runs it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

import celery_throttle
from celery_throttle import throttle
from tests.helpers import BROKER_URL, STORE_URL

pytest_plugins = ("celery.contrib.pytest",)  # what pytest-celery enables for you


#: Every key these tests write starts with it: the throttle's, and (a kombu and Celery
#: option) the broker's and the results', so that the clean-up finds them all.
PREFIX = "example-tests"


@pytest.fixture(scope="session")
def celery_config() -> dict:
    return {"broker_url": BROKER_URL, "result_backend": BROKER_URL,
            "broker_transport_options": {"global_keyprefix": f"{PREFIX}:"},
            "result_backend_transport_options": {"global_keyprefix": f"{PREFIX}:"},
            "throttle_redis_url": STORE_URL, "throttle_key_prefix": PREFIX}


@pytest.fixture(scope="module", autouse=True)
def _clean_keys() -> Iterator[None]:
    # (module-wide: the session's worker and its queue outlive each test; a test's own
    # throttle keys are gone by the module's end all the same)
    yield
    for url in (STORE_URL, BROKER_URL):
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"{PREFIX}*"):
            client.delete(key)
        client.close()


def test_a_burst_is_held_to_its_limit(celery_app, celery_worker) -> None:
    ctl = celery_throttle.install(celery_app)
    delays: list[float] = []

    def on_throttled(sender, delay, **_) -> None:
        delays.append(delay)

    celery_throttle.signals.task_throttled.connect(on_throttled)

    @celery_app.task
    @throttle("2/s", scope="example-api")
    def fetch(n):
        return n

    celery_worker.reload()  # the worker started before the task existed
    try:
        results = [fetch.delay(i) for i in range(4)]
        assert [r.get(timeout=30) for r in results] == [0, 1, 2, 3]
        assert len(delays) >= 2  # two of the four had to wait
        assert ctl.status("example-api").rates[0].used >= 2
    finally:
        celery_throttle.signals.task_throttled.disconnect(on_throttled)


def test_eager_calls_are_never_throttled(celery_app) -> None:
    celery_throttle.install(celery_app)

    @celery_app.task
    @throttle("1/h", scope="example-eager")
    def add(a, b):
        return a + b

    assert [add.apply(args=(i, 1)).get() for i in range(3)] == [1, 2, 3]
