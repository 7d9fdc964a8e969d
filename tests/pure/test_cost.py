"""The cost is checked in one place (core/cost.py): a throttle declared with a cost and a
direct ``acquire`` given the same cost accept and refuse alike, and count the same units in
each rate. Pure: no Redis."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_throttle.core.cost import declared_cost, direct_cost
from celery_throttle.core.errors import ConfigurationError
from celery_throttle.core.rates import parse_rates
from celery_throttle.core.spec import ThrottleSpec, direct_call

RATES = ("100/s", "1000 tokens/m")

#: Costs as users write them, good and bad: ints (zero, negative, a bool), other types,
#: and costs by unit (a unit the rates count, one they do not, a name that is no unit).
COSTS = st.one_of(
    st.integers(-3, 60), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3), st.none(),
    st.dictionaries(st.sampled_from(["tokens", "token", "Tokens!", "", "requests"]),
                    st.one_of(st.integers(-2, 60), st.booleans(), st.text(max_size=2)), max_size=3),
)


def _outcome(check: Any) -> Any:
    try:
        return check()
    except ConfigurationError:
        return "refused"


@given(COSTS)
def test_a_declared_cost_and_a_direct_cost_are_accepted_and_refused_alike(cost: Any) -> None:
    declared = _outcome(lambda: ThrottleSpec.declare(RATES, cost=cost).bind(
        "t", None, (), {}, "sliding", "p").cost)
    direct = _outcome(lambda: direct_call("p", "sliding", "t", None, RATES, cost, None).cost)
    assert declared == direct, (cost, declared, direct)


def test_the_shared_check_refuses_what_neither_path_may_take() -> None:
    # The check itself, against a mutation that would let a bad cost through both paths
    # alike (the property above alone would not see it): zero, a bool, an unknown unit.
    rates = parse_rates(RATES)
    for bad in (0, -1, True, "3", {"token": 5}, {"tokens": 0}, {}):
        with pytest.raises(ConfigurationError):
            declared_cost(bad, rates)
        with pytest.raises(ConfigurationError):
            direct_cost(bad, rates)
    assert direct_cost(7, rates) == 7
    assert direct_cost({"tokens": 30}, rates) == (("tokens", 30),)
    # A direct acquire has no task arguments to call a callable cost on.
    with pytest.raises(ConfigurationError, match="not a callable"):
        direct_cost(lambda: 1, rates)
