"""What the store holds, as data (core/state.py): the name of a rate's field in the state
hash is read back as the rate it names, and no other field is taken for a rate, so
``status`` shows only the rates a hash holds. Pure: no Redis."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from celery_throttle.core.rates import Rate
from celery_throttle.core.state import ALGORITHM_TAGS, CONTROL_STAMP, rate_field, rate_of_field

UNITS = st.one_of(st.just(""), st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True))


@given(st.sampled_from(sorted(ALGORITHM_TAGS)), st.integers(1, 10**9), st.integers(1, 10**12), UNITS)
def test_a_rates_field_is_read_back_as_the_rate_it_names(algorithm: str, limit: int, period_us: int,
                                                        unit: str) -> None:
    rate = Rate(limit, period_us / 1_000_000, unit)
    assert rate_of_field(rate_field(algorithm, rate)) == (algorithm, limit, rate.period_us, unit)


@given(st.text(max_size=30))
def test_no_other_field_is_taken_for_a_rate(field: str) -> None:
    named = rate_of_field(field)
    if named is not None:
        # Only a field of the shape rate_field writes: read again, it is that same field.
        algorithm, limit, period_us, unit = named
        assert rate_field(algorithm, Rate(limit, period_us / 1_000_000, unit)) == field


def test_the_hashs_own_fields_are_not_rates() -> None:
    # The state hash's format and line fields, and the control hash's stamp.
    for field in ("f", "e", "d", "v", "lm", CONTROL_STAMP, "s", "s10", "s10/", "x10/100", "s10/100.Tok", "s-1/100",
                  "s0/100", "s10/0", "s\u00b2/100", "s10/\u0661\u0660", "s010/100", "s10/100.", "s10/100\n"):
        assert rate_of_field(field) is None, field
