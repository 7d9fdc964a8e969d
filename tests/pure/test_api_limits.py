"""The API's own count, read from reply headers (celery_throttle/core/api_limits.py): the
header sets of major APIs, written from their public documentation, and anything else a
reply (or a proxy) may carry. Pure: no Redis (a body that brings its key to the API's count
on real workers is tests/workers/test_settle.py)."""

from __future__ import annotations

from datetime import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_throttle.core.api_limits import MOST_RESET, exhausted, remaining, resets

#: (API, headers as its documentation shows them, what they leave by unit)
HEADER_SETS = [
    ("OpenAI", {"x-ratelimit-limit-requests": "60", "x-ratelimit-limit-tokens": "150000",
                "x-ratelimit-remaining-requests": "59", "x-ratelimit-remaining-tokens": "149984",
                "x-ratelimit-reset-requests": "1s", "x-ratelimit-reset-tokens": "6m0s"},
     {"": 59, "tokens": 149984}),
    ("Anthropic", {"anthropic-ratelimit-requests-limit": "50", "anthropic-ratelimit-requests-remaining": "49",
                   "anthropic-ratelimit-requests-reset": "2026-12-06T08:00:01Z",
                   "anthropic-ratelimit-tokens-limit": "40000", "anthropic-ratelimit-tokens-remaining": "39000",
                   "anthropic-ratelimit-input-tokens-limit": "30000",
                   "anthropic-ratelimit-input-tokens-remaining": "29500",
                   "anthropic-ratelimit-output-tokens-limit": "8000",
                   "anthropic-ratelimit-output-tokens-remaining": "7500", "retry-after": "3"},
     {"": 49, "tokens": 39000, "input_tokens": 29500, "output_tokens": 7500}),
    ("GitHub", {"X-RateLimit-Limit": "5000", "X-RateLimit-Remaining": "4999", "X-RateLimit-Used": "1",
                "X-RateLimit-Reset": "1372700873", "X-RateLimit-Resource": "core"},
     {"": 4999}),
    ("Discord", {"X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1470173023.123",
                 "X-RateLimit-Reset-After": "1.2", "X-RateLimit-Bucket": "abcd1234"},
     {"": 0}),
    ("X", {"x-rate-limit-limit": "900", "x-rate-limit-remaining": "847", "x-rate-limit-reset": "1705420000"},
     {"": 847}),
    ("IETF draft (first fields)", {"RateLimit-Limit": "100", "RateLimit-Remaining": "50", "RateLimit-Reset": "50"},
     {"": 50}),
    ("IETF draft (one field, earlier)", {"RateLimit": "limit=100, remaining=50, reset=5"}, {"": 50}),
    ("IETF draft (structured, now)", {"RateLimit-Policy": '"burst";q=100;w=60,"daily";q=1000;w=86400',
                                      "RateLimit": '"burst";r=10;t=20, "daily";r=600;t=3600'},
     {"": 10}),
    ("Stripe (no count, a 429 only)", {"Request-Id": "req_123", "Stripe-Version": "2024-06-20"}, {}),
]


@pytest.mark.parametrize(("api", "headers", "left"), HEADER_SETS, ids=[s[0] for s in HEADER_SETS])
def test_the_count_each_api_sends_is_read_by_unit(api: str, headers: dict[str, str], left: dict[str, int]) -> None:
    assert remaining(headers) == left
    # (a requests/httpx response's headers are a case-insensitive mapping; bytes too)
    assert remaining({k.upper().encode(): v.encode() for k, v in headers.items()}) == left


def test_what_does_not_read_as_a_count_is_ignored_never_guessed() -> None:
    assert remaining({"x-ratelimit-remaining": "soon"}) == {}
    assert remaining({"x-ratelimit-remaining": "-5"}) == {}
    assert remaining({"x-ratelimit-remaining": "9" * 40}) == {}  # (no number that long)
    assert remaining({"x-ratelimit-remaining": "7.0"}) == {"": 7}
    assert remaining({"x-ratelimit-remaining": "4", "x-rate-limit-remaining": "2"}) == {"": 2}  # (the least)
    assert remaining({"ratelimit": "r=" + "1" * 5000}) == {}  # (cut at a bound: read no further)
    assert remaining(None) == {} and remaining("x-ratelimit-remaining: 3") == {}


@given(st.dictionaries(st.one_of(st.text(max_size=40), st.binary(max_size=40)),
                       st.one_of(st.text(max_size=200), st.binary(max_size=200), st.integers()), max_size=12))
def test_any_headers_at_all_read_as_counts_or_nothing(headers: dict) -> None:
    left = remaining(headers)
    assert all(isinstance(v, int) and v >= 0 for v in left.values())
    assert set(left) <= {"", "tokens", "input_tokens", "output_tokens"}


def _at(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


#: (API, headers of a reply that leaves nothing, now (Unix time), the seconds until it takes a
#: call again, by unit): the sets above with a count at 0, as each API's documentation says it.
EXHAUSTED = [
    ("OpenAI, requests", {"x-ratelimit-remaining-requests": "0", "x-ratelimit-remaining-tokens": "149984",
                          "x-ratelimit-reset-requests": "1s", "x-ratelimit-reset-tokens": "6m0s"}, 0.0, {"": 1.0}),
    ("OpenAI, tokens", {"x-ratelimit-remaining-requests": "59", "x-ratelimit-remaining-tokens": "0",
                        "x-ratelimit-reset-requests": "1s", "x-ratelimit-reset-tokens": "6m0s"}, 0.0,
     {"tokens": 360.0}),
    ("OpenAI, a compound and a short duration", {"x-ratelimit-remaining-requests": "0",
                                                  "x-ratelimit-reset-requests": "1m30.5s",
                                                  "x-ratelimit-remaining-tokens": "0",
                                                  "x-ratelimit-reset-tokens": "20ms"}, 0.0,
     {"": 90.5, "tokens": 0.02}),
    ("Anthropic", {"anthropic-ratelimit-requests-remaining": "0",
                   "anthropic-ratelimit-requests-reset": "2026-12-06T08:00:01Z",
                   "anthropic-ratelimit-tokens-remaining": "39000",
                   "anthropic-ratelimit-tokens-reset": "2026-12-06T08:01:00Z"}, _at("2026-12-06T08:00:00Z"), {"": 1.0}),
    ("GitHub", {"X-RateLimit-Limit": "5000", "X-RateLimit-Remaining": "0", "X-RateLimit-Used": "5000",
                "X-RateLimit-Reset": "1372700873", "X-RateLimit-Resource": "core"}, 1372700800.0, {"": 73.0}),
    ("Discord (a Unix time and seconds after: the longer)", {
        "X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1470173023.123",
        "X-RateLimit-Reset-After": "1.2", "X-RateLimit-Bucket": "abcd1234"}, 1470173022.0, {"": 1.2}),
    ("X", {"x-rate-limit-limit": "900", "x-rate-limit-remaining": "0", "x-rate-limit-reset": "1705420000"},
     1705419100.0, {"": 900.0}),
    ("Reddit (seconds, not a time)", {"x-ratelimit-used": "100", "x-ratelimit-remaining": "0.0",
                                      "x-ratelimit-reset": "472"}, 1705419100.0, {"": 472.0}),
    ("IETF draft (first fields)", {"RateLimit-Limit": "100", "RateLimit-Remaining": "0", "RateLimit-Reset": "50"},
     0.0, {"": 50.0}),
    ("IETF draft (one field, earlier)", {"RateLimit": "limit=100, remaining=0, reset=5"}, 0.0, {"": 5.0}),
    ("IETF draft (structured: the policy with nothing left)", {
        "RateLimit-Policy": '"burst";q=100;w=60,"daily";q=1000;w=86400',
        "RateLimit": '"burst";r=0;t=20, "daily";r=600;t=3600'}, 0.0, {"": 20.0}),
    ("GitHub, calls left", {"X-RateLimit-Remaining": "12", "X-RateLimit-Reset": "1372700873"}, 1372700800.0, {}),
    ("GitHub, a reset past", {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1372700873"}, 1372700900.0,
     {"": 0.0}),
    ("a reset beyond a day", {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset-After": "999999"}, 0.0, {}),
    ("no reset beside it", {"X-RateLimit-Remaining": "0"}, 0.0, {}),
]


@pytest.mark.parametrize(("api", "headers", "now", "wait"), EXHAUSTED, ids=[s[0] for s in EXHAUSTED])
def test_when_an_api_that_has_nothing_left_takes_a_call_again_is_read_beside_its_count(
        api: str, headers: dict[str, str], now: float, wait: dict[str, float]) -> None:
    assert exhausted(headers, now) == pytest.approx(wait)
    assert exhausted({k.upper().encode(): v.encode() for k, v in headers.items()}, now) == pytest.approx(wait)


#: Header names the reading knows (a random dictionary rarely hits them).
KNOWN = sorted({name.lower() for _, headers, _, _ in EXHAUSTED for name in headers})


@given(st.dictionaries(st.one_of(st.sampled_from(KNOWN), st.text(max_size=40), st.binary(max_size=40)),
                       st.one_of(st.sampled_from(["0", "1s", "6m0s", "472", "1372700873", "r=0;t=9"]),
                                 st.text(max_size=200), st.binary(max_size=200), st.integers()), max_size=12),
       st.floats(0, 4e9))
def test_any_headers_at_all_read_as_a_wait_within_a_day_or_nothing(headers: dict, now: float) -> None:
    wait = exhausted(headers, now)
    assert all(isinstance(v, float) and 0.0 <= v <= MOST_RESET for v in wait.values())
    assert set(wait) <= {"", "tokens", "input_tokens", "output_tokens"}


def test_a_reset_is_read_beside_its_own_count_whatever_is_left() -> None:
    # (observe() charges no difference for a unit whose API window resets sooner than its rate's)
    openai = dict(HEADER_SETS[0][1])
    assert resets(openai, 0.0) == {"": (59, 1.0), "tokens": (149984, 360.0)}
    assert resets({"RateLimit": '"burst";r=10;t=20, "daily";r=600;t=3600'}, 0.0) == {"": (10, 20.0)}
    assert resets({"X-RateLimit-Remaining": "3"}, 0.0) == {}  # (no reset beside it)
