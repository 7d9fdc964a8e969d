"""The API's own count, read from reply headers (celery_throttle/core/api_limits.py): the
header sets of major APIs, written from their public documentation, and anything else a
reply (or a proxy) may carry. Pure: no Redis (a body that brings its key to the API's count
on real workers is tests/workers/test_settle.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_throttle.core.api_limits import remaining

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
