"""The pause after a store error of the optional checks (celery_throttle.check.breaker)."""

from __future__ import annotations

from celery_throttle.check.breaker import Breaker


def test_a_breaker_is_closed_until_tripped_then_open_for_its_pause() -> None:
    breaker = Breaker(60.0)
    assert not breaker.open
    breaker.trip()
    assert breaker.open


def test_a_breaker_whose_pause_is_over_is_closed_again() -> None:
    breaker = Breaker(-1.0)  # (a pause that ended as it began)
    breaker.trip()
    assert not breaker.open
    breaker.pause = 60.0
    breaker.trip()
    assert breaker.open
