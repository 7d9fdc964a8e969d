"""Priority within a key's line, on the real script: places by urgency, first come first
served within a level, and the aging rule (a task of urgency u passes at most u *
PRIORITY_STEP tasks that came before it; one behind the default is passed by at most as
many that came after it). The walks of test_line_model.py hold the script to its twin with
urgencies at random; here, the order a line is released in, by hand."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_throttle.core.keys import state_key, window_keys
from celery_throttle.core.protocol import Code, Entry, WindowCall
from celery_throttle.core.rates import parse_rate
from celery_throttle.core.timing import ScriptPolicy
from celery_throttle.store.client import RedisStore
from tests.helpers import STORE_URL
from tests.line_walk import FakeClock


def released_order(store: RedisStore, clock: FakeClock, key: str, call: WindowCall) -> list[str]:
    """Every task of the line, in the order the releases take them (each arriving at once)."""
    order: list[str] = []
    for _ in range(200):
        reply = store.release(key, call, 64)
        for r in reply.reported:
            order.append(r.id)
            assert store.claim(key, call, r.id, early_us=1_000_000, holder=f"h-{r.id}").code in (Code.RUN, Code.RUN_AT)
        if not store._redis.exists(window_keys(key)[2]) and not reply.out:
            return order
        clock.now += 1_000_000
    raise AssertionError(f"the line never emptied: {order}")


@pytest.fixture
def store(redis_client: redis.Redis, key_prefix: str, clock: FakeClock) -> Iterator[RedisStore]:
    # (A step of 2 places a level: the aging rule within a short line.)
    s = RedisStore(STORE_URL, key_prefix, clock=clock, policy=ScriptPolicy(priority_step=2))
    yield s
    s.close()


@pytest.mark.parametrize("algorithm", ["sliding", "fixed"])
def test_a_line_goes_by_urgency_within_its_aging_bound_and_first_come_first_served_in_a_level(
        store: RedisStore, clock: FakeClock, key_prefix: str, algorithm: str) -> None:
    # Given a key of 1/s whose one start is taken, and tasks joining its line in this order
    # (name: urgency), with 2 places a level
    call = WindowCall(algorithm, (parse_rate("1/s"),), 1, slack_us=10_000)
    key = state_key(key_prefix, "prio", algorithm)
    assert store.acquire(key, call, entry=Entry("first", b"m", "first")).code == Code.RUN
    joined = [("a1", 0), ("a2", 0), ("a3", 0), ("a4", 0), ("b", 1), ("c", 9), ("low", -1), ("a5", 0), ("a6", 0),
              ("a7", 0), ("c2", 9)]
    for name, urgency in joined:
        reply = store.acquire(key, call, entry=Entry(name, b"m-" + name.encode(), name, urgency=urgency))
        assert reply.code == Code.QUEUED, (name, reply)
    # And Backoff's front, which goes before everyone whatever their priority
    assert store.front(key, call, Entry("front", b"m", "front")).code == Code.QUEUED
    # When the line is released
    order = released_order(store, clock, key, call)
    # Then: front first; c and c2 (9 levels: before the 18 that came last before each) in
    # the order they came; b (1 level) before the 2 that came last before it, a3 and a4;
    # "low" (1 level behind) after the 2 that came next, a5 and a6; the rest first come
    # first served
    assert order == ["front", "c", "c2", "a1", "a2", "b", "a3", "a4", "a5", "a6", "low", "a7"], order
