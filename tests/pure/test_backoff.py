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
    assert unavailable.value.seconds == 5 and unavailable.value.asked == 5
    # (no Retry-After and no default: the API did not say, and the pause is the throttle's)
    with pytest.raises(celery_throttle.Backoff) as silent:
        celery_throttle.backoff_from(Response(503, {"Retry-After": "soon"}))
    assert silent.value.asked is None and silent.value.seconds == 1.0


def test_a_refusal_without_retry_after_pauses_briefly_and_longer_only_while_refusals_repeat(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_throttle.core.backoff import DEFAULT_BACKOFF, Backoff
    from celery_throttle.integration import backing_off

    clock = [1000.0]
    monkeypatch.setattr(backing_off.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(backing_off, "_streaks", backing_off.OrderedDict())
    window = 1_000_000  # (a rate of one second)

    def pause(retry_after: object = None, adaptive: bool = False, ident: tuple = ("api", "acme")) -> float:
        return backing_off.pause_for(Backoff(retry_after), adaptive=adaptive, window_us=window, ident=ident)

    # Under adapt: the lowered limit is the answer, unless the API asks for more than a window
    assert pause(adaptive=True) == 0 and pause("1", adaptive=True) == 0 and pause("7", adaptive=True) == 7
    # Without: what the API asks for; when it says nothing, a second first
    assert pause("12") == 12
    assert pause() == 1.0
    # and a burst of refusals of calls already under way is the same refusal (no growth)
    clock[0] += 0.5
    assert pause() == pytest.approx(1.0) and pause(ident=("api", "other")) == 1.0
    # Refused again once each pause is over: twice as long each time, at most DEFAULT_BACKOFF
    seen = []
    for _ in range(8):
        clock[0] += seen[-1] + 0.1 if seen else 1.0
        seen.append(pause())
    assert seen == [2, 4, 8, 16, DEFAULT_BACKOFF, DEFAULT_BACKOFF, DEFAULT_BACKOFF, DEFAULT_BACKOFF]
    # and after a quiet spell (no refusal within REPEAT_WITHIN of the pause's end), a second again
    clock[0] += DEFAULT_BACKOFF + backing_off.REPEAT_WITHIN + 1
    assert pause() == 1.0


def test_a_refusal_after_a_call_of_its_key_returned_is_a_limits_refusal_and_pauses_briefly_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # (A throttle declared above the API's limit is refused after every pause, with calls
    # taken in between: doubling there ran one second in 30.)
    from celery_throttle.core.backoff import Backoff
    from celery_throttle.core.spec import BoundCall
    from celery_throttle.integration import backing_off, settle

    clock = [1000.0]
    monkeypatch.setattr(backing_off.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(backing_off, "_streaks", backing_off.OrderedDict())

    def pause(key: str = "acme") -> float:
        return backing_off.pause_for(Backoff(None), adaptive=False, window_us=1_000_000, ident=("api", key))

    def returned(task_id: str, key: str) -> None:
        settle.started(task_id, BoundCall("api", key, (), 1, "sliding", f"state:{key}"), None)
        backing_off.returned(task_id)
        settle.ended(task_id)

    # Given refusals that repeat after each pause, nothing taken in between: they grow
    assert [pause(), (clock.__setitem__(0, clock[0] + 1.1), pause())[1]] == [1.0, 2.0]
    # When a call of another key returns, the key's streak stands; of the key, it ends
    returned("t-other", "other")
    clock[0] += 2.1
    assert pause() == 4.0
    returned("t-1", "acme")
    clock[0] += 4.1
    # Then the next refusal is a limit's: a short pause again
    assert pause() == 1.0
