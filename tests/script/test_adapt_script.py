"""Adaptive limits in the scripts: adapt.lua's lowering and window.lua's limits in force
against core/adapt.py's law (the reference), on a real Redis with a test clock.

For any sequence of pushbacks and moments, the level adapt.lua keeps is the one the law
gives (once per window; fast convergence while climbing back), and a burst at any moment
after them is admitted exactly as far as the law's share of each rate allows (at least a
call's own units), whichever algorithm; a law that differs by a hair is caught.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import find, given, settings

from celery_throttle.core import adapt as law
from celery_throttle.core.adapt import Adapt, Pushback, pushed_level, refined_level, scaled_limit
from celery_throttle.core.config import ALGORITHMS
from celery_throttle.core.keys import state_key
from celery_throttle.core.protocol import WindowCall
from celery_throttle.core.rates import parse_rate
from celery_throttle.store.client import RedisStore
from tests.helpers import QUICK, STORE_URL, redis_or_skip

BASE_US = 1_800_000_000_000_000
#: The share of the ceiling a refused call is, in these tests.
UNIT = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = BASE_US

    def __call__(self) -> int:
        return self.now


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    c = redis_or_skip(STORE_URL)
    yield c
    c.close()


@pytest.fixture(scope="module")
def world(client: redis.Redis) -> Iterator[tuple[RedisStore, Clock, str]]:
    clock, prefix = Clock(), f"ct-test-{uuid.uuid4().hex[:12]}"
    store = RedisStore(STORE_URL, prefix, clock=clock)
    yield store, clock, prefix
    store.close()
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)


def reference(adapt: Adapt, steps: list[tuple[int, float]], window_us: int) -> list[tuple[float, bool]]:
    """(level after, lowered) of each pushback, ``steps`` (µs after the last, the share of
    the ceiling the window holds) apart, as the law has them."""
    pushed: Pushback | None = None
    now, out, refused = BASE_US, [], 0.0
    for step, used in steps:
        now += step
        before = law.level(adapt, pushed, now, window_us)
        if pushed is not None and now - pushed.at_us < window_us:
            refused = float(f"{refused + UNIT:.6f}")
            refined = refined_level(adapt, pushed.w_max, used, refused)
            if refined is not None:
                pushed = pushed._replace(w_max=float(f"{refined:.6f}"))
            out.append((round(law.level(adapt, pushed, now, window_us), 6), False))
            continue
        refused = UNIT
        earlier = law.level(adapt, pushed, now - window_us, window_us)
        pushed = Pushback(float(f"{pushed_level(adapt, pushed, before, earlier, used):.6f}"), now, "backoff")
        out.append((round(law.level(adapt, pushed, now, window_us), 6), True))
    return out


def lowered(store: RedisStore, clock: Clock, key: str, adapt: Adapt, steps: list[tuple[int, float]],
            window_us: int) -> list[tuple[float, bool]]:
    """(level after, lowered) of each pushback, as adapt.lua has them."""
    clock.now, got = BASE_US, []
    for step, used in steps:
        clock.now += step
        _, after, low = store.lower(key, (adapt.floor, adapt.decrease, adapt.growth), window_us, "backoff", used,
                                    UNIT)
        got.append((round(after, 6), low))
    return got


adapts = st.builds(Adapt, floor=st.sampled_from([0.05, 0.1, 0.3]), decrease=st.sampled_from([0.5, 0.7, 0.85]),
                   growth=st.sampled_from([0.0005, 0.005, 0.05]))
steps = st.lists(st.tuples(st.sampled_from([0, 1_000, 300_000, 1_500_000, 6_000_000, 12_000_000]),
                           st.sampled_from([1.0, 0.8, 0.35, 0.05])), min_size=1, max_size=8)


@settings(max_examples=30 if QUICK else 150, deadline=None)
@given(adapts, steps, st.sampled_from(["10/s", "100/s", "40/2s"]), st.integers(0, 30_000_000),
       st.sampled_from(ALGORITHMS), st.integers(1, 3))
def test_the_scripts_lower_once_per_window_and_admit_what_the_law_allows(
        world: tuple[RedisStore, Clock, str], adapt: Adapt, gaps: list[int], rate: str, after: int,
        algorithm: str, cost: int) -> None:
    store, clock, prefix = world
    key = state_key(prefix, "adaptive", uuid.uuid4().hex)
    rates = (parse_rate(rate),)
    window_us = rates[0].period_us
    # Given pushbacks of the key, gaps apart
    # Then adapt.lua kept the levels the law gives, lowering once per window
    assert lowered(store, clock, key, adapt, gaps, window_us) == reference(adapt, gaps, window_us)
    # And a burst later, in a window of its own, starts what the law's share allows
    clock.now += after + 10 * window_us
    raw = redis.Redis.from_url(STORE_URL).hget(key, "A")
    share = law.level(adapt, Pushback.read(raw.decode()), clock.now, window_us)
    expected = scaled_limit(rates[0].limit, share, cost) // cost
    call = WindowCall(algorithm, rates, cost, slack_us=1000, adapt=(adapt.floor, adapt.decrease, adapt.growth))
    started = 0
    while store.acquire(key, call).allowed and started <= rates[0].limit:
        started += 1
    assert started == expected, (share, started, expected)


def test_without_a_pushback_an_adaptive_key_is_at_its_ceiling(world: tuple[RedisStore, Clock, str]) -> None:
    store, _, prefix = world
    key = state_key(prefix, "adaptive", "fresh")
    call = WindowCall("sliding", (parse_rate("7/s"),), 1, slack_us=1000, adapt=(0.1, 0.7, 0.005))
    assert sum(store.acquire(key, call).allowed for _ in range(10)) == 7


@pytest.mark.parametrize("mutation", ["decrease", "growth"])
def test_the_check_catches_a_law_that_differs_from_the_scripts(
        world: tuple[RedisStore, Clock, str], mutation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store, clock, prefix = world
    real = law.level

    def off(adapt: Adapt, pushback: Pushback | None, now_us: int, window_us: int) -> float:
        # (a hair off: a hundredth of the decrease or of the growth)
        changed = Adapt(adapt.floor, adapt.decrease * (1.01 if mutation == "decrease" else 1.0),
                        adapt.growth * (1.01 if mutation == "growth" else 1.0))
        return real(changed, pushback, now_us, window_us)

    monkeypatch.setattr(law, "level", off)

    def differs(case: tuple[Adapt, list[tuple[int, float]]]) -> bool:
        adapt, gaps = case
        key = state_key(prefix, "adaptive", uuid.uuid4().hex)
        return lowered(store, clock, key, adapt, gaps, 1_000_000) != reference(adapt, gaps, 1_000_000)

    assert differs(find(st.tuples(adapts, steps), differs, settings=settings(max_examples=500, deadline=None)))
