"""The rates in force under the controls (celery_throttle/check/control_fields.py): a live
rate takes the place of the declared rate of its window only, or of all of them when it
replaces all. Pure: no Redis (the control hash itself is tests/script/test_controls.py)."""

from __future__ import annotations

import pytest

import celery_throttle
from celery_throttle.check.control_fields import merged_rates, parse_controls
from celery_throttle.core.rates import parse_rates


def _rates(*texts: str) -> tuple[celery_throttle.Rate, ...]:
    return parse_rates(list(texts))


@pytest.mark.parametrize(("declared", "live", "in_force"), [
    (("10/s", "5000/h"), ("2/s",), ("2/s", "5000/h")),
    (("10/s", "5000/h"), ("20/s",), ("20/s", "5000/h")),  # raised, the hourly quota still holds
    (("10/s",), ("2/s", "100/m"), ("2/s", "100/m")),
    (("6/s", "9/3s"), ("1000/h",), ("6/s", "9/3s", "1000/h")),
    # a rate of a named unit is a window of its own, beside the calls' of the same length
    (("500/m", "30000 tokens/m"), ("100/m",), ("100/m", "30000 tokens/m")),
    (("500/m", "30000 tokens/m"), ("10000 tokens/m",), ("500/m", "10000 tokens/m")),
    ((), ("2/s",), ("2/s",)),
])
def test_a_live_rate_takes_the_place_of_the_declared_rate_of_its_window_only(
        declared: tuple[str, ...], live: tuple[str, ...], in_force: tuple[str, ...]) -> None:
    assert merged_rates(_rates(*declared) if declared else (), _rates(*live)) == _rates(*in_force)


def test_a_live_limit_that_replaces_all_leaves_only_its_own_rates() -> None:
    assert merged_rates(_rates("10/s", "5000/h"), _rates("2/s"), replace_all=True) == _rates("2/s")


def test_the_replace_field_goes_with_the_limit_it_sits_beside() -> None:
    # Given a scope-wide limit that replaces all, and a key's own that does not
    controls = parse_controls({"limit:api": "2/s", "replace:api": "all", "limit:api:acme": "1/s"})
    declared = _rates("10/s", "5000/h")
    # Then the scope's other keys run under 2/s alone, the key under 1/s and the hourly quota
    assert controls.rates_of("api", None, declared) == _rates("2/s")
    assert controls.rates_of("api", "globex", declared) == _rates("2/s")
    assert controls.rates_of("api", "acme", declared) == _rates("1/s", "5000/h")
    # and a scope without a live limit, as declared
    assert controls.rates_of("other", None, declared) == declared


def test_a_live_mode_is_the_keys_own_else_its_scopes_else_the_apps() -> None:
    # Given the whole app in shadow mode, one scope enforcing, and one key of it in shadow
    controls = parse_controls({"mode:*": "shadow", "mode:api": "enforce", "mode:api:acme": "shadow",
                               "mode:other": "loud"})
    # Then each call is under the nearest mode set
    assert controls.mode_of("api", "acme") == "shadow"
    assert controls.mode_of("api", "globex") == "enforce"
    assert controls.mode_of("api", None) == "enforce"
    assert controls.mode_of("billing", "acme") == "shadow"
    # and a mode written by hand that does not read is skipped (the app's holds), never fatal
    assert controls.mode_of("other", None) == "shadow"
    # and without any, none is set (the code's and throttle_mode then say)
    assert parse_controls({}).mode_of("api", "acme") is None

