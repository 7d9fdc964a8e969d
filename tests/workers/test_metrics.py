"""Metrics (the prometheus extra) and the log summary, from a real in-process worker."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

import celery_throttle
from celery_throttle import throttle
from tests.helpers import BROKER_URL, STORE_URL, delete_queues, delete_results_under, results_under, wait_for

prometheus_client = pytest.importorskip("prometheus_client")


@pytest.fixture
def app(prefix: str) -> Iterator[Celery]:
    app = Celery(f"metrics-{prefix}", broker=BROKER_URL, backend=BROKER_URL, set_as_current=False)
    app.conf.update(task_default_queue=prefix, result_expires=60, broker_connection_retry_on_startup=True,
                    worker_hijack_root_logger=False)
    celery_throttle.install(app, redis_url=STORE_URL, key_prefix=prefix)
    app.conf.update(results_under(prefix))
    yield app
    app.close()
    delete_queues(BROKER_URL, [prefix])
    delete_results_under(prefix)


def _sample(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def test_counters_by_scope_and_a_summary_of_denials_in_the_log(
        app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    scope = f"metrics-api-{uuid.uuid4().hex[:6]}"
    ran: list[float] = []

    @app.task(shared=False)
    @throttle("3/s", scope=scope)
    def call() -> None:
        ran.append(time.time())

    ctl = celery_throttle.install(app)
    # When 8 calls are sent at once to a worker (one more with a long wait: parked)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        for _ in range(9):
            call.delay()
        wait_for(lambda: len(ran) >= 9, 30, 0.05, f"9 runs (have {len(ran)})")
        with caplog.at_level(logging.INFO, logger="celery_throttle"):
            ctl.metrics.summarize(force=True)
    # Then every start and every deferral is counted under the scope
    assert _sample("celery_throttle_admitted_total", scope=scope) == 9
    denied = _sample("celery_throttle_denied_total", scope=scope)
    assert denied >= 6  # at publish, in the consumer or in the pool: 6 of 9 had to wait
    assert _sample("celery_throttle_deferred_seconds_total", scope=scope) >= 6 * 0.3
    assert _sample("celery_throttle_parked_total", scope=scope) >= 1  # waits of 1 s or more
    assert _sample("celery_throttle_released_total") >= 1
    summary = [r.getMessage() for r in caplog.records if "throttled in the last" in r.getMessage()]
    assert any(f"scope={scope} key=None" in line for line in summary), summary


@pytest.mark.pure
def test_the_summary_is_written_on_its_interval_without_a_later_denial(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from celery_throttle.check import metrics

    monkeypatch.setattr(metrics, "SUMMARY_INTERVAL", 0.3)
    counts = metrics.Metrics()
    caplog.set_level(logging.INFO, logger="celery_throttle")
    counts.denied("summary-scope", "acme", 2.0)  # the one denial: nothing follows it

    def summary() -> list[str]:
        return [r.getMessage() for r in caplog.records if "throttled in the last" in r.getMessage()]

    wait_for(summary, 10, what="the summary of a lone denial")
    assert "scope=summary-scope key=acme: 1 task(s) deferred, 2.0s on average" in summary()[0]


@pytest.mark.pure
def test_the_summary_escapes_what_would_forge_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    from celery_throttle.check import metrics

    # Given a denial of a key whose id holds a newline and an escape sequence
    counts = metrics.Metrics()
    caplog.set_level(logging.INFO, logger="celery_throttle")
    counts.denied("api", "acme\n[2026-12-03 08:00:00,000: ERROR/MainProcess] forged\x1b[31m", 1.0)
    # When the summary is written
    counts.summarize(force=True)
    # Then it is one line, the key shown by its repr
    line = next(r.getMessage() for r in caplog.records if "throttled in the last" in r.getMessage())
    assert "\n" not in line and "\x1b" not in line
    assert "key='acme\\n[2026-12-03" in line, line


def test_a_task_that_would_wait_past_its_max_wait_is_counted(app: Celery) -> None:
    from celery_throttle import WaitTooLong

    scope = f"metrics-capped-{uuid.uuid4().hex[:6]}"
    ran: list[float] = []

    @app.task(shared=False)
    @throttle("1/m", scope=scope, max_wait=2)
    def capped() -> None:
        ran.append(time.time())

    # When 3 calls are sent at once to a worker: the first runs, the next two would wait
    # a minute for their start, past their max_wait of 2 s
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        results = [capped.delay() for _ in range(3)]
        wait_for(lambda: sum(r.ready() for r in results) == 3, 30, 0.1, "3 results")
    # Then the two that failed with WaitTooLong are counted under the scope, and only they
    failed = [r for r in results if r.failed()]
    assert len(ran) == 1 and len(failed) == 2
    assert all(isinstance(r.result, WaitTooLong) for r in failed), [r.result for r in failed]
    assert _sample("celery_throttle_wait_exceeded_total", scope=scope) == 2
