"""Live limits and pauses as the control hash holds them (celery_throttle/check/controls.py):
which rates are in force under a live limit, and what a pause leaves of the other controls.
(How the rates in force are merged, without Redis: tests/pure/test_control_fields.py.)"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

import celery_throttle
from celery_throttle import throttle
from celery_throttle.core.rates import parse_rates
from tests.helpers import STORE_URL


def _rates(*texts: str) -> tuple[celery_throttle.Rate, ...]:
    return parse_rates(list(texts))


@pytest.fixture
def ctl(prefix: str, store_client: redis.Redis) -> celery_throttle.Throttle:
    return celery_throttle.install(Celery("controls", broker="memory://", set_as_current=False),
                                   redis_url=STORE_URL, key_prefix=prefix)


def test_a_live_limit_keeps_the_declared_quota_of_another_window_in_force(ctl: celery_throttle.Throttle) -> None:
    # Given a scope declared 10/s and 3/h, raised live to 100/s (an operator who wants
    # more per second, not an unlimited hour)
    declared = ["10/s", "3/h"]
    ctl.set_limit("github-api", ["100/s"])
    # When 4 calls come at once
    allowed = [ctl.acquire("github-api", rates=declared).allowed for _ in range(4)]
    # Then the hourly quota still stops the fourth, and status says both rates are in force
    assert allowed == [True, True, True, False]
    status = ctl.status("github-api")
    assert {str(r.rate): r.used for r in status.rates} == {"100/s": 3, "3/h": 3}
    assert not status.live_replaces_all


def test_a_live_limit_set_to_replace_all_lifts_the_other_windows_until_cleared(
        ctl: celery_throttle.Throttle) -> None:
    declared = ["10/s", "3/h"]
    # Given 100/s in place of every declared rate
    ctl.set_limit("github-api", ["100/s"], replace=True)
    # Then the hourly quota is not counted: 5 calls go
    assert all(ctl.acquire("github-api", rates=declared).allowed for _ in range(5))
    assert ctl.status("github-api").live_replaces_all
    # and set again without replace, the hourly quota is back (empty: it counted nothing)
    ctl.set_limit("github-api", ["100/s"])
    assert [ctl.acquire("github-api", rates=declared).allowed for _ in range(4)] == [True, True, True, False]
    # and cleared, the field that replaced all is gone with the limit
    assert ctl.clear_limit("github-api")
    assert ctl.store.controls() == {}
    with pytest.raises(celery_throttle.ConfigurationError, match="give the rates"):
        ctl.set_limit("github-api", concurrency=2, replace=True)


def test_a_decorated_tasks_call_is_bound_under_the_merged_rates(ctl: celery_throttle.Throttle) -> None:
    # Given a task declared 10/s and 5000/h (the issue's GitHub task), and a live 2/s
    @ctl.app.task(name="sync_issues")
    @throttle("10/s", "5000/h", scope="github-api")
    def sync_issues(repo: str) -> None: ...

    ctl.set_limit("github-api", ["2/s"])
    # Then a call is bound, and listed, under 2/s and 5000/h
    call = ctl.checker.bind(ctl.app.tasks[sync_issues.name], ("acme/widgets",), {})
    assert call.rates == _rates("2/1.02s", "5000/3600.02s")  # (each sliding window with its margin)
    assert ctl.declared_rates("github-api") == (_rates("10/s", "5000/h"), False)
    assert ctl.rates_in_force("github-api") == _rates("2/s", "5000/h")
    ctl.set_limit("github-api", ["2/s"], replace=True)
    assert ctl.rates_in_force("github-api") == _rates("2/s")


def test_a_pause_leaves_live_limits_and_concurrency_limits_alone(ctl: celery_throttle.Throttle) -> None:
    # Given a live concurrency limit (its value all digits, as a pause's end) and a
    # limit that replaces all
    ctl.set_limit("export-api", concurrency=4)
    ctl.set_limit("github-api", ["2/s"], replace=True)
    # When another scope is paused (which forgets the pauses that are over)
    ctl.pause("vendor", seconds=30)
    # Then both controls are still set
    controls = ctl.store.controls()
    assert controls["slots:export-api"] == "4" and controls["replace:github-api"] == "all", controls
    ctl.resume("vendor")


def test_a_mode_is_the_live_one_else_the_throttles_else_the_apps(prefix: str, store_client: redis.Redis) -> None:
    # Given an app in shadow mode (throttle_mode), a task whose throttle enforces, a rule in
    # shadow mode, and a task that says nothing
    app = Celery("modes", broker="memory://", set_as_current=False)
    app.conf.throttle_rules = {"vendor.*": {"rate": "5/s", "mode": "shadow"}}
    ctl = celery_throttle.install(app, redis_url=STORE_URL, key_prefix=prefix, mode="shadow")

    @app.task(name="modes.strict")
    @throttle("1/s", key="{tenant}", mode="enforce")
    def strict(tenant: str) -> None: ...

    @app.task(name="modes.plain")
    @throttle("1/s", key="{tenant}")
    def plain(tenant: str) -> None: ...

    def shadow(task_name: str, tenant: str = "acme") -> bool:
        known = ctl.checker.known(app, task_name, None)
        assert known is not None
        return ctl.checker.bind_spec(task_name, known.spec, known.signature, (tenant,), {}).shadow

    # Then each is in its own mode, the app's where it says none
    assert (shadow("modes.strict"), shadow("modes.plain"), shadow("vendor.sync")) == (False, True, True)
    # And a live mode goes first: a key's before its scope's, a scope's before the app's
    ctl.set_mode("shadow", "modes.strict", key="acme")
    ctl.set_mode("enforce", "modes.plain")
    assert (shadow("modes.strict"), shadow("modes.strict", "globex"), shadow("modes.plain")) == (True, False, False)
    ctl.set_mode("enforce")  # (the whole app, live: below any scope's or key's live mode)
    assert (shadow("vendor.sync"), shadow("modes.strict")) == (False, True)
    assert ctl.live_mode() == "enforce" and ctl.live_mode("modes.plain") == "enforce"
    # And cleared, the code's again
    for scope, key in ((None, None), ("modes.plain", None), ("modes.strict", "acme")):
        assert ctl.clear_mode(scope, key=key)
    assert (shadow("modes.strict"), shadow("modes.plain"), shadow("vendor.sync")) == (False, True, True)
    with pytest.raises(celery_throttle.ConfigurationError, match="a key's mode needs its scope"):
        ctl.set_mode("shadow", key="acme")
    with pytest.raises(celery_throttle.ConfigurationError, match="mode 'loud'"):
        ctl.set_mode("loud", "modes.plain")
