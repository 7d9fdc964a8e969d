"""Throttled tasks are never run unthrottled without a word, whatever the order of set-up.

In-process workers (``celery.contrib.testing.worker.start_worker``, Celery's own test
pattern), each on an app of its own: ``install()`` forgotten, called after the worker
was built, and tasks defined after the worker started, then ``worker.reload()``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

import celery_throttle
from celery_throttle import throttle
from celery_throttle.core.protocol import NO_ENTRY
from tests.helpers import (
    BROKER_URL,
    STORE_URL,
    delete_queues,
    delete_results_under,
    max_started_in,
    results_under,
    wait_for,
)


@pytest.fixture
def app(prefix: str) -> Iterator[Celery]:
    """A fresh app with a queue and key prefix of its own (no install() yet). Its tasks
    are made with ``shared=False``: a shared task would join every app made after it."""
    app = Celery(f"wiring-{prefix}", broker=BROKER_URL, backend=BROKER_URL, set_as_current=False)
    app.conf.update(task_default_queue=prefix, throttle_redis_url=STORE_URL, throttle_key_prefix=prefix,
                    throttle_release_interval=0.2, result_expires=60,
                    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)
    app.conf.update(results_under(prefix))
    yield app
    app.close()
    delete_queues(BROKER_URL, [prefix])
    delete_results_under(prefix)


class Starts:
    """Start times of task bodies run by an in-process worker."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._lock = threading.Lock()

    def note(self) -> None:
        with self._lock:
            self.times.append(time.time())

    def wait(self, count: int, timeout: float) -> list[float]:
        wait_for(lambda: len(self.times) >= count, timeout, 0.05, f"{count} starts (have {len(self.times)})")
        time.sleep(0.3)
        return sorted(self.times)


def _worker(app: Celery) -> object:
    return start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20,
                        hostname=f"wiring-{uuid.uuid4().hex[:6]}@localhost")


def test_throttle_works_without_install_and_says_so(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    # Given a throttled task on an app that never had install() called
    starts = Starts()

    @app.task(shared=False)
    @throttle("3/s")
    def fetch() -> None:
        starts.note()

    # When a worker of that app starts and 9 calls arrive at once
    with caplog.at_level(logging.WARNING, logger="celery_throttle"), _worker(app):
        for _ in range(9):
            fetch.delay()
        times = starts.wait(9, timeout=20)
    # Then the limit holds, and the log says install() was missing and was done for it
    assert max_started_in(times, 1.0) <= 3
    assert any("install(app) was never called" in r.getMessage() and fetch.name in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("order", ["below", "above"])
def test_a_task_defined_after_the_worker_started_is_hooked_at_reload(app: Celery, order: str) -> None:
    # Given an installed app whose worker is already running
    celery_throttle.install(app)
    starts = Starts()
    with _worker(app) as worker:
        # When a throttled task is defined afterwards, in either decorator order, and
        # the worker reloads its tasks (Celery's celery_worker.reload())
        def body() -> None:
            starts.note()

        if order == "below":
            task = app.task(name=f"late-{order}", shared=False)(throttle("3/s")(body))
        else:
            task = throttle("3/s")(app.task(name=f"late-{order}", shared=False)(body))
        worker.reload()
        for _ in range(9):
            task.delay()
        times = starts.wait(9, timeout=20)
    # Then its limit holds
    assert max_started_in(times, 1.0) <= 3


def test_install_after_the_worker_was_built_still_releases_parked_tasks(
        app: Celery, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a worker built before install() was called, and with no throttled task when it
    # started (so not installed at start either: in this process, the shared tasks of the
    # other test modules join every app, so that start-time install is switched off here)
    monkeypatch.setattr(celery_throttle.integration.worker, "_install_if_forgotten", lambda app: None)
    starts = Starts()
    with caplog.at_level(logging.WARNING, logger="celery_throttle"), _worker(app) as worker:
        ctl = celery_throttle.install(app)

        @app.task(shared=False)
        @throttle("2/3s")
        def export() -> None:
            starts.note()

        worker.reload()
        # When more calls arrive than the window admits (the rest wait in their line)
        for _ in range(4):
            export.delay()
        # Then the waits are parked in Redis, and released and run by this worker
        wait_for(lambda: ctl.lines.total_waiting() > 0 or len(starts.times) >= 4, 10, 0.05, "a parked task")
        times = starts.wait(4, timeout=20)
    assert max_started_in(times, 3.0) <= 2
    assert any("already built" in r.getMessage() for r in caplog.records)


def test_the_consumer_screens_each_message_once(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an installed app that checks nothing at publish, a task allowed one start an
    # hour, and a worker (its consumer builds the strategies and screens them, then the
    # screen step starts)
    # (The 5 turned away wait in their key's line, in the store under the test's prefix.)
    ctl = celery_throttle.install(app, check_at_publish=False)
    starts = Starts()

    @app.task(shared=False)
    @throttle("1/h")
    def export() -> None:
        starts.note()

    screened: list[str] = []
    real_screen = ctl.checker.screen

    def counting_screen(call, entry=NO_ENTRY):
        # (a message may be screened without its message first, then with it: one entry)
        screened.append(entry.task_id)
        return real_screen(call, entry)

    monkeypatch.setattr(ctl.checker, "screen", counting_screen)
    with _worker(app):
        # When 6 calls arrive
        for _ in range(6):
            export.delay()
        wait_for(lambda: len(set(screened)) >= 6, 20, 0.05, "6 screened messages")
        time.sleep(1.0)
    # Then each was screened once: the first fitted and ran, the 5 others were turned away
    # (into the line) before the pool saw them
    assert len(starts.times) == 1
    assert len(set(screened)) == 6
    assert ctl.status(export.name).waiting == 5
