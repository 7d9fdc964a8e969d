"""Admission at publish: a producer defers a throttled task that does not fit.

The producer here is an app of its own configured like the workers (same task, same
throttle, same store and prefix), as a real deployment's producer is; the workers are
real subprocesses. The other behaviour tests send by name (``send_task``), which skips
this step, so they keep testing the worker's own checks.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chord

import celery_throttle
from celery_throttle.signals import task_throttled
from tests.helpers import BROKER_URL, WorkerGroup, free_port, max_in_window


def _producer(workers: WorkerGroup, store: str | None = None) -> tuple[Celery, dict[str, Any]]:
    """An app that sends ``tests.taskapp``'s tasks with the same code as the workers, as a
    real producer importing the task module does (``@app.task`` tasks are shared with every
    app), configured for the workers' store and prefix."""
    import tests.taskapp  # noqa: F401  (registers the shared tasks)

    app = Celery(f"producer-{uuid.uuid4().hex[:6]}", broker=workers.broker,
                 backend=BROKER_URL, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, task_default_queue=workers.queue,
                    result_expires=600, throttle_redis_url=store or workers.store,
                    throttle_key_prefix=workers.prefix, throttle_park_after=3)
    celery_throttle.install(app)
    app.finalize()
    return app, {name: app.tasks[f"tests.taskapp.{name}"] for name in ("slow_quota", "collect")}


def _close(app: Celery, *results: Any) -> None:
    celery_throttle.install(app).close()
    for result in results:  # (else their __del__ opens a pubsub connection to unsubscribe)
        app.backend.remove_pending_result(result)
    app.backend.result_consumer.stop()
    app.backend.client.connection_pool.disconnect()
    app.close()


@pytest.fixture
def denied_at_publish() -> Iterator[list[dict[str, Any]]]:
    """Every denial the producer makes (the signal fires in the producer's process)."""
    seen: list[dict[str, Any]] = []

    def note(sender: Any, request: Any, delay: float, scope: str, key: str, parked: bool, **_: Any) -> None:
        seen.append({"key": key, "delay": delay, "parked": parked})

    task_throttled.connect(note, weak=False)
    yield seen
    task_throttled.disconnect(note)


def _label() -> str:
    return uuid.uuid4().hex[:10]


def test_a_flood_of_one_tenant_waits_outside_the_queue_and_other_tenants_start_at_once(
    workers: WorkerGroup, denied_at_publish: list[dict[str, Any]]
) -> None:
    # Given a producer of a 3/4s-per-tenant task, and parking after 3 s
    app, tasks = _producer(workers)
    label, flood, other = _label(), f"flood-{_label()}", f"other-{_label()}"
    # When tenant A sends 15 tasks at once, then tenant B sends 3
    a_ids = [tasks["slow_quota"].delay(label, flood).id for _ in range(15)]
    sent_b = time.time()
    b_ids = [tasks["slow_quota"].delay(label, other).id for _ in range(3)]
    # Then the producer turned away A's 12 over the quota (parked: the shortest wait is
    # 4 s), none of B's, and only A's first 3 and B's 3 were queued
    assert [d["key"] for d in denied_at_publish] == [flood] * 12
    assert all(d["parked"] for d in denied_at_publish)
    # And B's tasks started at once, while every one of A's ran once within its limit
    starts = workers.wait_starts(label, 18, timeout=40)
    by_id = {e["id"]: e for e in starts}
    assert sorted(by_id) == sorted(a_ids + b_ids) and len(starts) == 18
    assert max(by_id[i]["t"] for i in b_ids) - sent_b < 2.0
    assert max_in_window([by_id[i]["t"] for i in a_ids], 4.0) <= 3
    # And the workers did not have to turn the flood away (at most a task or two released
    # from parking a little late, which a worker sends to the back of the line)
    assert len([d for d in workers.denials() if d["id"] in a_ids + b_ids]) <= 3
    _close(app)


def test_a_chord_whose_tasks_were_parked_at_publish_still_completes(
    workers: WorkerGroup, denied_at_publish: list[dict[str, Any]]
) -> None:
    # Given a chord of 5 tasks of one tenant under 3/4s, with an unthrottled callback
    app, tasks = _producer(workers)
    label, tenant = _label(), f"chord-{_label()}"
    header = [tasks["slow_quota"].s(label, tenant) for _ in range(5)]
    # When it is sent (2 of the 5 parked by the producer)
    result = chord(header)(tasks["collect"].s(label))
    # Then all 5 ran, and the callback ran once with the 5 results
    starts = workers.wait_starts(label, 6, timeout=40)
    assert sum(1 for d in denied_at_publish if d["parked"]) == 2
    callbacks = [e for e in starts if "n" in e]
    assert [e["n"] for e in callbacks] == [5]
    assert max_in_window([e["t"] for e in starts if "n" not in e], 4.0) <= 3
    _close(app, result)


def test_a_producer_that_cannot_reach_the_store_sends_unchecked_and_the_workers_throttle(
    workers: WorkerGroup, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a producer whose throttle store is down (nothing listens on its port)
    app, tasks = _producer(workers, store=f"redis://127.0.0.1:{free_port()}/0")
    label, tenant = _label(), f"nostore-{_label()}"
    # When it sends 6 tasks of a 3/4s tenant
    with caplog.at_level(logging.WARNING, logger="celery_throttle"):
        ids = [tasks["slow_quota"].delay(label, tenant).id for _ in range(6)]
    # Then it said so once (not once per task), every task was sent, and the workers,
    # which reach the store, held the limit
    assert sum("unreachable at publish" in r.getMessage() for r in caplog.records) == 1
    starts = workers.wait_starts(label, 6, timeout=30)
    assert sorted(e["id"] for e in starts) == sorted(ids)
    assert max_in_window([e["t"] for e in starts], 4.0) <= 3
    _close(app)
