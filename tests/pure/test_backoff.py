"""Back-off from a 429 or 503 downstream (celery_throttle/core/backoff.py): how long a
``Retry-After`` says, and which responses raise ``Backoff``. Pure: no Redis (a task that
backs off on real workers is tests/workers/test_operate.py)."""

from __future__ import annotations

import pytest

import celery_throttle


def test_retry_after_reads_seconds_and_http_dates_and_falls_back_on_anything_else() -> None:
    from datetime import datetime, timedelta, timezone
    from email.utils import format_datetime

    from celery_throttle.core.backoff import DEFAULT_BACKOFF, MIN_BACKOFF, retry_after_seconds

    now = 1_800_000_000.0
    in_two_minutes = format_datetime(datetime.fromtimestamp(now, timezone.utc) + timedelta(minutes=2), usegmt=True)
    assert retry_after_seconds("30", now) == 30
    assert retry_after_seconds(b" 7 ", now) == 7
    assert retry_after_seconds(2.5, now) == 2.5
    assert retry_after_seconds(in_two_minutes, now) == pytest.approx(120)
    assert retry_after_seconds("0", now) == MIN_BACKOFF  # "now" still means not now
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now) == MIN_BACKOFF  # past
    for unreadable in (None, "soon", "", "nan", float("inf"), True, object()):
        assert retry_after_seconds(unreadable, now) == DEFAULT_BACKOFF


def test_backoff_from_raises_on_429_and_503_only() -> None:
    class Response:
        def __init__(self, status: int, headers: dict[str, str]) -> None:
            self.status_code, self.headers = status, headers

    ok = Response(200, {})
    assert celery_throttle.backoff_from(ok) is ok
    with pytest.raises(celery_throttle.Backoff) as too_many:
        celery_throttle.backoff_from(Response(429, {"Retry-After": "12"}))
    assert too_many.value.seconds == 12
    with pytest.raises(celery_throttle.Backoff) as unavailable:
        celery_throttle.backoff_from(Response(503, {}), default=5)
    assert unavailable.value.seconds == 5
