"""Rate strings and Redis key building: properties over any input, and declaration errors.

No Redis needed: everything here is pure functions.
"""

from __future__ import annotations

import inspect
import math
import re
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from celery_throttle.core.errors import ConfigurationError, KeyBuildError
from celery_throttle.core.keys import MAX_TOKEN, check_prefix, encode, state_key
from celery_throttle.core.rates import Rate, parse_rate, parse_rates
from celery_throttle.core.spec import ThrottleSpec

SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
SPELLINGS = {
    "s": ["s", "sec", "second", "seconds"],
    "m": ["m", "min", "minute", "minutes"],
    "h": ["h", "hour", "hours"],
    "d": ["d", "day", "days"],
}
KNOWN_UNITS = {u for names in SPELLINGS.values() for u in names} | {"ms"}


def names_what_is_accepted(message: str) -> bool:
    return '"10/s"' in message and '"5/10s"' in message and "periods: ms, s, m, h, d" in message and "30000 tokens/m" in message


# -- rates ---------------------------------------------------------------------------------


@st.composite
def rate_texts(draw: Any) -> tuple[str, Rate]:
    """A valid rate string in any accepted spelling, and the rate it means."""
    limit = draw(st.integers(1, 10**6))
    unit = draw(st.sampled_from(sorted(SECONDS)))
    count = draw(st.one_of(st.none(), st.integers(1, 1000)))
    spelling = draw(st.sampled_from(SPELLINGS[unit]))
    spelling = draw(st.sampled_from([spelling, spelling.upper(), spelling.capitalize()]))
    space = st.sampled_from(["", " ", "  "])
    text = (f"{draw(space)}{limit}{draw(space)}/{draw(space)}"
            f"{'' if count is None else count}{draw(space)}{spelling}{draw(space)}")
    return text, Rate(limit, (count or 1) * SECONDS[unit])


@given(rate_texts())
@example(("10/s", Rate(10, 1)))
@example(("100/m", Rate(100, 60)))
@example(("1000/h", Rate(1000, 3600)))
@example(("5000/d", Rate(5000, 86400)))
@example(("5/10s", Rate(5, 10)))
@example(("100/5m", Rate(100, 300)))
def test_every_accepted_spelling_parses_to_its_rate(case: tuple[str, Rate]) -> None:
    text, expected = case
    assert parse_rate(text) == expected
    assert parse_rate(text).period_us == int(expected.period) * 1_000_000


@given(st.integers(1, 10**6), st.sampled_from(sorted(SECONDS)), st.integers(1, 5000))
def test_a_rate_round_trips_through_str(limit: int, unit: str, count: int) -> None:
    # Given "N/<count><unit>", e.g. "7/90s" or "3/2h"
    rate = parse_rate(f"{limit}/{count}{unit}")
    # When it is printed and parsed back
    text = str(rate)
    # Then it is the same rate, printed the same way
    assert parse_rate(text) == rate
    assert str(parse_rate(text)) == text
    # And in canonical form: the largest whole unit, its count left out when 1
    # ("N/s", not "N/1s"; "N/m", not "N/60s")
    match = re.fullmatch(r"(\d+)/([1-9]\d*)?([smhd])", text)
    assert match, text
    printed_count, printed_unit = int(match.group(2) or 1), match.group(3)
    assert match.group(2) != "1"
    period = count * SECONDS[unit]
    assert printed_unit == next(u for u in "dhms" if period % SECONDS[u] == 0)
    assert printed_count * SECONDS[printed_unit] == period


@given(st.integers(1, 10**6), st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True), st.integers(1, 5000),
       st.sampled_from(sorted(SECONDS)))
def test_a_rate_of_a_named_unit_round_trips_and_differs_from_the_calls_rate(
        limit: int, unit: str, count: int, period: str) -> None:
    # Given "N tokens/<count><period>"
    rate = parse_rate(f"{limit} {unit}/{count}{period}")
    # Then it counts that unit, prints as it was written (canonically), and reads back
    assert rate.unit == unit and rate.limit == limit
    assert parse_rate(str(rate)) == rate and str(rate).startswith(f"{limit} {unit}/")
    # and is another rate than the same one of the call's own units
    assert rate != parse_rate(f"{limit}/{count}{period}")


@pytest.mark.parametrize("text", ["1/4007ms", "1/4015ms", "1/1.001s", "1/2.5ms"])
def test_a_millisecond_or_decimal_rate_round_trips_through_str(text: str) -> None:
    rate = parse_rate(text)
    assert parse_rate(str(rate)).period_us == rate.period_us, str(rate)


@given(st.text(max_size=40).filter(lambda t: "/" not in t))
@example("")
@example("   ")
@example("10")
@example("10 per second")
def test_text_without_a_slash_is_refused_naming_what_is_accepted(text: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_rate(text)
    assert names_what_is_accepted(str(info.value))
    assert repr(text) in str(info.value)


@given(st.integers(1, 1000), st.text(alphabet=string.ascii_letters, min_size=1, max_size=8))
@example(5, "fortnight")
@example(5, "msec")
@example(5, "w")
@example(5, "y")
def test_an_unknown_unit_is_refused_naming_what_is_accepted(limit: int, unit: str) -> None:
    assume(unit.lower() not in KNOWN_UNITS)
    with pytest.raises(ConfigurationError) as info:
        parse_rate(f"{limit}/{unit}")
    assert names_what_is_accepted(str(info.value))


@pytest.mark.parametrize("text", [
    "-5/s", "5/-1s", "5/s/s", "five/s", "5/", "/s", "5.5/s", "5/1.s", "5/.5s", "5/1e3s",
    "5/s,", "5 5/s", "0x10/s", "5//s", "5/s s",
])
def test_malformed_rates_are_refused_naming_what_is_accepted(text: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_rate(text)
    assert names_what_is_accepted(str(info.value))


@pytest.mark.parametrize("value", [None, 10, 10.0, b"10/s", ["10/s"], {"rate": "10/s"}])
def test_a_rate_that_is_not_a_string_is_refused_naming_what_is_accepted(value: Any) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_rate(value)
    assert names_what_is_accepted(str(info.value))


@pytest.mark.parametrize("text", ["0/s", "0/10m", "1/0s", "1/0ms", "1/0.5ms", "1/0.0009s"])
def test_a_zero_count_or_sub_millisecond_period_is_refused(text: str) -> None:
    with pytest.raises(ConfigurationError, match="at least 1 and the period between 1ms and 10000d"):
        parse_rate(text)


@given(st.text(max_size=30))
@example("1/" + "9" * 30 + "d")
def test_any_text_gives_a_usable_rate_or_a_configuration_error(text: str) -> None:
    try:
        rate = parse_rate(text)
    except ConfigurationError:
        return
    assert rate.limit >= 1 and math.isfinite(rate.period) and rate.period >= 0.001
    assert rate.period_us >= 1000
    str(rate)


def test_a_period_too_long_to_represent_is_refused() -> None:
    with pytest.raises(ConfigurationError):
        rate = parse_rate("1/" + "9" * 400 + "s")
        _ = rate.period_us  # what the store sends to Redis


@given(st.lists(rate_texts(), min_size=1, max_size=6))
def test_parse_rates_gives_distinct_sorted_rates(cases: list[tuple[str, Rate]]) -> None:
    parsed = parse_rates([text for text, _ in cases])
    assert list(parsed) == sorted({rate for _, rate in cases})


# -- keys ------------------------------------------------------------------------------------

PREFIXES = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.:\-]{0,30}\Z")

AWKWARD = st.text(alphabet=":{}*?[] %#\\\"'\t\n|/", max_size=12)
UNICODE = st.text(max_size=40)  # any code point but lone surrogates
HUGE = st.builds(lambda piece, n: (piece * (10_000 // len(piece) + 1))[:n],
                 st.text(min_size=1, max_size=4), st.integers(9_990, 10_010))
LONGISH = st.text(alphabet="ab%:é", min_size=MAX_TOKEN // 3 - 2, max_size=MAX_TOKEN + 2)
TENANTS = st.one_of(st.just(""), AWKWARD, UNICODE, HUGE, LONGISH)
SCOPES = st.one_of(AWKWARD, UNICODE, HUGE, LONGISH).filter(bool)  # a scope is never empty
KEYS = st.one_of(st.none(), TENANTS)


def cluster_hash_tag(key: str) -> str | None:
    """The part Redis Cluster hashes: between the first '{' and the next '}', if non-empty."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end < 0 or end == start + 1:
        return None
    return key[start + 1:end]


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(PREFIXES, SCOPES, KEYS)
@example("throttle", "github-api", "tenant:{42}*")
@example("throttle", "a}b", "{x")
@example("throttle", "scope", "")
@example("throttle", "scope", "x" * 10_000)
@example("throttle", "\u00e9\U0001f600", "\u202e\u0000")
def test_a_state_key_is_the_prefix_then_one_bounded_hash_tag(
    prefix: str, scope: str, key: str | None
) -> None:
    k = state_key(prefix, scope, key)
    # Then it starts with "<prefix>:" and the hash tag comes right after
    assert k.startswith(prefix + ":{")
    assert k.endswith("}")
    # And it holds exactly one brace of each kind: a valid Redis Cluster hash tag
    assert k.count("{") == 1 and k.count("}") == 1
    assert cluster_hash_tag(k) == k[len(prefix) + 2:-1]
    # And it stays short, printable ASCII, with nothing a SCAN pattern would interpret
    assert len(k) < 300
    tag = cluster_hash_tag(k)
    assert tag and tag.isascii() and tag.isprintable()
    assert not set(tag) & set(" *?[]\\{}")


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(PREFIXES, st.tuples(SCOPES, KEYS), st.tuples(SCOPES, KEYS))
@example("t", ("a:b", "c"), ("a", "b:c"))
@example("t", ("a", None), ("a", ""))
@example("t", ("a", "b"), ("a:b", None))
@example("t", ("a", "%3A"), ("a", ":"))
@example("t", ("a", "x" * 200), ("a", "x" * 199))
@example("t", ("a", "x" * 200), ("a", "#" + "x" * 199))
@example("t", ("a", "x" * 10_000 + "1"), ("a", "x" * 10_000 + "2"))
@example("t", ("{a}", "b"), ("a", "{b}"))
def test_two_different_scope_key_pairs_never_share_a_redis_key(
    prefix: str, first: tuple[str, str | None], second: tuple[str, str | None]
) -> None:
    assume(first != second)
    assert state_key(prefix, *first) != state_key(prefix, *second)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.tuples(SCOPES, KEYS), min_size=2, max_size=30, unique=True))
def test_many_tenants_get_as_many_keys(pairs: list[tuple[str, str | None]]) -> None:
    assert len({state_key("throttle", s, k) for s, k in pairs}) == len(pairs)


@given(st.text(max_size=MAX_TOKEN + 10))
def test_an_encoded_component_is_brace_and_colon_free_and_bounded(text: str) -> None:
    token = encode(text)
    assert len(token) <= MAX_TOKEN
    assert not set(token) & set(":{} *")


@pytest.mark.parametrize("tenant", ["\ud800", "ok-\udfff", "x" * 200 + "\ud800"],
                         ids=["lone", "trailing", "long"])
def test_a_tenant_with_a_lone_surrogate_still_gets_its_own_key(tenant: str) -> None:
    key = state_key("throttle", "scope", tenant)
    assert key != state_key("throttle", "scope", tenant.replace("\ud800", "?").replace("\udfff", "?"))


@pytest.mark.script
@pytest.mark.parametrize("prefix", ["", " throttle", "throttle ", "thr{ottle", "throttle}"])
def test_a_prefix_with_braces_or_surrounding_spaces_is_refused(prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="throttle_key_prefix"):
        check_prefix(prefix)


# -- binding a call to its key ----------------------------------------------------------------

TASK = "tasks.sync_repo"


def sync_repo(tenant: Any, repo: str = "main") -> None:  # the task body: never run
    pass


SIGNATURE = inspect.signature(sync_repo)
TENANT_SPEC = ThrottleSpec.declare(["10/s", "1000/h"], key="{tenant}")


def bound_key(tenant: Any, *, by_keyword: bool = False) -> str:
    args, kwargs = ((), {"tenant": tenant}) if by_keyword else ((tenant,), {})
    call = TENANT_SPEC.bind(TASK, SIGNATURE, args, kwargs, "sliding", "throttle")
    assert call.scope == TASK and call.rates == parse_rates(["10/s", "1000/h"])
    return state_key("throttle", call.scope, call.key)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(TENANTS.filter(bool), TENANTS.filter(bool), st.booleans())
@example("acme:eu", "acme", False)
@example("{acme}", "acme", True)
@example("*", "**", False)
@example("x" * 10_000, "x" * 10_001, False)
def test_two_tenants_never_share_a_key(first: str, second: str, by_keyword: bool) -> None:
    assume(first != second)
    # Given a throttle keyed by "{tenant}"; When two calls bind with different tenants
    a, b = bound_key(first, by_keyword=by_keyword), bound_key(second)
    # Then their keys differ, and each is a well-formed, bounded key
    assert a != b
    for k in (a, b):
        assert k.startswith(f"throttle:{{{encode(TASK)}:") and k.count("{") == 1 and len(k) < 300


@given(st.integers(-10**30, 10**30))
def test_a_non_string_tenant_binds_like_its_text(tenant: int) -> None:
    assert bound_key(tenant) == bound_key(str(tenant))


@pytest.mark.parametrize("tenant", [None, ""])
@pytest.mark.parametrize("by_keyword", [False, True])
def test_a_missing_tenant_fails_the_call_naming_task_and_argument(tenant: Any, by_keyword: bool) -> None:
    with pytest.raises(KeyBuildError) as info:
        bound_key(tenant, by_keyword=by_keyword)
    message = str(info.value)
    assert TASK in message and "'tenant'" in message


def test_a_call_that_does_not_fit_the_signature_fails_naming_the_task() -> None:
    with pytest.raises(KeyBuildError, match=re.escape(TASK)):
        TENANT_SPEC.bind(TASK, SIGNATURE, (), {}, "sliding", "throttle")


def test_a_key_template_naming_a_missing_argument_fails_at_check_signature() -> None:
    spec = ThrottleSpec.declare(["10/s"], key="{tenant_id}:{region}")

    def task(tenant_id: str, repo: str) -> None:
        pass

    with pytest.raises(ConfigurationError) as info:
        spec.check_signature(task, f"task {TASK}")
    message = str(info.value)
    assert TASK in message and "'region'" in message


def test_check_signature_accepts_named_arguments_and_kwargs() -> None:
    spec = ThrottleSpec.declare(["10/s"], key="{tenant_id}")

    def named(tenant_id: str) -> None:
        pass

    def catch_all(**kwargs: Any) -> None:
        pass

    spec.check_signature(named, "task a")
    spec.check_signature(catch_all, "task b")


# -- declaring a throttle ---------------------------------------------------------------------


@pytest.mark.parametrize("rates", [["10/fortnight"], ["10/s", "ten/m"], ["0/s"], []])
def test_declaring_a_bad_rate_is_refused(rates: list[str]) -> None:
    with pytest.raises(ConfigurationError):
        ThrottleSpec.declare(rates)


@pytest.mark.parametrize("algorithm", ["leaky", "token-bucket", "Sliding", ""])
def test_declaring_an_unknown_algorithm_is_refused_naming_the_known_ones(algorithm: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        ThrottleSpec.declare(["10/s"], algorithm=algorithm)
    assert "sliding" in str(info.value) and "fixed" in str(info.value)


@pytest.mark.parametrize("cost", [0, -1, True, False, 1.0, 2.5, "2", None])
def test_declaring_a_cost_that_is_not_a_positive_integer_is_refused(cost: Any) -> None:
    with pytest.raises(ConfigurationError, match="cost must be a positive integer"):
        ThrottleSpec.declare(["10/s"], cost=cost)


@given(st.lists(st.integers(1, 50), min_size=1, max_size=4, unique=True), st.integers(1, 60))
def test_declaring_a_cost_above_the_tightest_limit_is_refused(limits: list[int], cost: int) -> None:
    # Given rates of distinct periods, e.g. ["3/1s", "20/2s"]
    rates = [f"{limit}/{i + 1}s" for i, limit in enumerate(limits)]
    if cost > min(limits):
        # Then a cost no window can ever hold is refused, naming the tightest rate
        with pytest.raises(ConfigurationError, match="can never fit") as info:
            ThrottleSpec.declare(rates, cost=cost)
        assert str(min(parse_rates(rates), key=lambda r: r.limit)) in str(info.value)
    else:
        assert ThrottleSpec.declare(rates, cost=cost).cost == cost


def test_a_cost_by_unit_binds_to_a_count_per_rate_each_of_its_unit() -> None:
    # Given requests and tokens of one API, the tokens estimated from the prompt
    spec = ThrottleSpec.declare(["500/m", "30000 tokens/m", "1000000 tokens/d"],
                                cost={"tokens": lambda prompt: len(prompt.split())})
    sig = inspect.signature(lambda prompt: None)
    # When a call binds
    call = spec.bind("llm", sig, ("a b c",), {}, "sliding", "t")
    # Then each rate counts its own unit's cost, in the rates' order (requests: 1)
    assert [str(r) for r in call.rates] == ["500/m", "30000 tokens/m", "1000000 tokens/d"]
    assert call.cost == (1, 3, 3) and call.unit_costs == (("tokens", 3),)
    # and a call costing the same in every rate is one count, as a one-unit call's
    assert spec.bind("llm", sig, ("one",), {}, "sliding", "t").cost == 1
    # A unit the callable prices badly fails that call, naming it
    with pytest.raises(KeyBuildError, match="cost of 'tokens' must be a positive integer"):
        spec.bind("llm", sig, ("",), {}, "sliding", "t")


def test_declaring_a_callable_rate_with_other_rates_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="callable rate must be the only rate"):
        ThrottleSpec.declare([lambda **_: "10/s", "100/m"])
    # A callable on its own is fine
    assert callable(ThrottleSpec.declare([lambda **_: "10/s"]).rates)


@pytest.mark.parametrize("key", ["", "{}", "{0}", "{tenant", "tenant}", 42])
def test_declaring_a_bad_key_template_is_refused(key: Any) -> None:
    with pytest.raises(ConfigurationError):
        ThrottleSpec.declare(["10/s"], key=key)


@pytest.mark.parametrize("scope", ["", 42])
def test_declaring_an_empty_or_non_string_scope_is_refused(scope: Any) -> None:
    with pytest.raises(ConfigurationError, match="scope"):
        ThrottleSpec.declare(["10/s"], scope=scope)


def test_a_task_is_released_from_a_far_store_earlier_by_its_round_trip() -> None:
    from celery_throttle.core.timing import release_lead_us, round_trip_allowance_us, slack_us

    rates = tuple(parse_rates(["10/s"]))
    # A store on this host: released 4 slacks ahead (a released task takes that long to
    # reach a pool process), at most half the rate's spacing (it waits there for its start)
    assert round_trip_allowance_us(300) == 0
    assert release_lead_us(rates) == min(4 * slack_us(rates), 100_000 // 2) == 40_000
    assert release_lead_us(tuple(parse_rates(["1000/m"]))) == 60_000 // 2
    # A store 95 ms away: its round trip too (rounded up to 10 ms, a few values only)
    assert round_trip_allowance_us(95_000) == 100_000
    assert release_lead_us(rates, round_trip_allowance_us(95_000)) == 140_000


def test_tenant_ids_of_a_mebibyte_are_not_kept_by_the_key_encoders_cache() -> None:
    # (an attacker's 100 ids of 1 MiB held 102 MiB in every process that bound them)
    from celery_throttle.core import keys

    state_key("throttle", "scope", "short")  # (the scope's own encoding is kept: it is short)
    before = keys._encode_cached.cache_info().currsize
    names = {state_key("throttle", "scope", f"{n:03d}" + "x" * (1 << 20)) for n in range(100)}
    assert len(names) == 100 and max(map(len, names)) < 300  # (each its own, bounded key)
    assert keys._encode_cached.cache_info().currsize == before
