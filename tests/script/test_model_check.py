"""The windows' edges, one by one, on the real script (the walks of every operation
against the model are in test_line_model.py).

A cost above a limit is refused and writes nothing; a cost equal to it fits an empty
window; a state no script wrote counts for nothing and is replaced; a sliding state of
an earlier layout still counts; a state of another format starts afresh; a fixed start
at a window's end counts where it may start; the state's TTL covers what it counts; a
reset forgets the windows and keeps the line; a day's limit stays small; publish records
nothing for a key with room; a lease or publish near a fixed window's end looks at the
next window too.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence

import msgpack
import pytest
import redis

from celery_throttle.core.keys import state_key, window_keys
from celery_throttle.core.protocol import Code, Entry, WindowCall
from celery_throttle.core.rates import Rate, parse_rate
from celery_throttle.core.state import STATE_FORMAT, rate_field
from celery_throttle.core.timing import SCRIPT_POLICY, ScriptPolicy
from celery_throttle.store.client import RedisStore
from tests.helpers import STORE_URL
from tests.line_walk import FakeClock
from tests.reference import BUCKETS, FixedRate, SlidingRate, max_units_per_aligned_window
from tests.script.conftest import BASE_US

ALGORITHMS = ("sliding", "fixed")
def rates_of(names: Sequence[str]) -> tuple[Rate, ...]:
    return tuple(parse_rate(n) for n in names)


def entry(message: bytes = b"m") -> Entry:
    return Entry(f"t:{uuid.uuid4().hex}", message, "task", 0, 0, 8)


@pytest.mark.parametrize("op", ["acquire", "peek", "admit", "claim"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cost_above_a_limit_is_refused_and_changes_nothing(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis, algorithm: str, op: str
) -> None:
    # Given a hash holding one admission, under "10/m" and "3/s"
    rates = rates_of(["10/m", "3/s"])
    key = state_key(store.prefix, "costly", "t")
    assert store.acquire(key, WindowCall(algorithm, rates, 1)).allowed
    before = {name: redis_client.dump(name) for name in window_keys(key)}
    clock.now += 1000
    # When a call costs 4, more than the 3 of "3/s" (a claim of a ticket this store never
    # released is such a call too)
    call = WindowCall(algorithm, rates, 4)
    reply = {"acquire": lambda: store.acquire(key, call, entry=entry()),
             "peek": lambda: store.peek(key, call),
             "admit": lambda: store.admit(key, call, entry()),
             "claim": lambda: store.claim(key, call, "forged:ticket", early_us=0, holder="h", entry=entry())}[op]()
    # Then it is refused with its code, and nothing written
    assert reply.code == Code.TOO_COSTLY and not reply.allowed
    assert {name: redis_client.dump(name) for name in window_keys(key)} == before


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_cost_equal_to_the_limit_fits_an_empty_window(store: RedisStore, algorithm: str) -> None:
    rates = rates_of(["3/s"])
    key = state_key(store.prefix, "exact", algorithm)
    reply = store.acquire(key, WindowCall(algorithm, rates, 3))
    assert reply.allowed and reply.remaining == 0
    assert store.peek(key, WindowCall(algorithm, rates, 1)).code == Code.DENIED


GARBLED = {
    "empty": b"",
    "not msgpack": b"\xc1",
    "a string": msgpack.packb("x"),
    "one number": msgpack.packb(5),
    "a header cut short": msgpack.packb(5) + msgpack.packb(BASE_US),
    "a list holding a string": msgpack.packb([BASE_US, "x"]),
}


@pytest.mark.parametrize("value", GARBLED.values(), ids=GARBLED.keys())
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_window_state_that_does_not_decode_counts_for_nothing_and_is_replaced(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis, algorithm: str, value: bytes
) -> None:
    # Given a rate's field holding something no script wrote
    rates = rates_of(["3/s"])
    key = state_key(store.prefix, "garbled", algorithm)
    field = rate_field(algorithm, rates[0])
    redis_client.hset(key, field, value)
    # When a call checks that rate
    reply = store.acquire(key, WindowCall(algorithm, rates, 1))
    # Then the field counted nothing, and holds a state the scripts wrote
    assert reply.allowed and reply.remaining == 2
    decode = (SlidingRate if algorithm == "sliding" else FixedRate).decode
    assert decode(redis_client.hget(key, field))[1::2] == [1]
    assert store.peek(key, WindowCall(algorithm, rates, 1)).remaining == 2


def test_a_sliding_state_of_a_development_format_is_started_afresh(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis
) -> None:
    # Given a sliding field as development versions wrote it (never released): one flat
    # list of latest, units
    rates = rates_of(["3/s"])
    key = state_key(store.prefix, "flat", "t")
    field = rate_field("sliding", rates[0])
    redis_client.hset(key, field, msgpack.packb([clock.now - 500_000, 1, clock.now - 1000, 1]))
    # When a call comes
    first = store.acquire(key, WindowCall("sliding", rates, 1))
    # Then it is not a window state: the field starts afresh, with that call alone
    assert first.allowed and first.remaining == 2
    assert SlidingRate.decode(redis_client.hget(key, field))[1::2] == [1]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("op", ["acquire", "screen", "peek"])
def test_a_state_of_another_format_is_started_afresh_and_one_without_is_ours(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis, algorithm: str, op: str
) -> None:
    # Given a full "2/s" window
    rates = rates_of(["2/s"])
    key = state_key(store.prefix, "format", f"{algorithm}-{op}")
    for _ in range(2):
        assert store.acquire(key, WindowCall(algorithm, rates, 1)).allowed
    assert redis_client.hget(key, "f") == str(STATE_FORMAT).encode()
    # When the hash has no format field (written before it existed), it is read as ours
    redis_client.hdel(key, "f")
    assert store.peek(key, WindowCall(algorithm, rates, 1)).remaining == 0
    # But when it says another format (a later version wrote it, the deploy rolled back)
    redis_client.hset(key, "f", STATE_FORMAT + 1)
    clock.now += 1000
    call = WindowCall(algorithm, rates, 1)
    reply = {"acquire": lambda: store.acquire(key, call), "screen": lambda: store.screen(key, call),
             "peek": lambda: store.peek(key, call)}[op]()
    # Then it is started afresh: nothing it counted counts, and a write makes it ours
    assert reply.code == Code.RUN
    assert reply.remaining == (2 if op in ("screen", "peek") else 1)
    if op == "acquire":
        assert redis_client.hget(key, "f") == str(STATE_FORMAT).encode()


def test_fixed_admission_at_the_end_of_a_window_counts_where_it_may_start(
    store: RedisStore, clock: FakeClock
) -> None:
    # Given a fixed "2/s" window, a 10 ms slack, and the clock at the last µs of a window
    rates, slack, period = rates_of(["2/s"]), 10_000, 1_000_000
    key = state_key(store.prefix, "fixed-slack", "t")
    clock.now = (BASE_US // period + 5) * period - 1
    # When a call of cost 2 is admitted there, and another of cost 2 asks 1 µs later
    first = store.acquire(key, WindowCall("fixed", rates, 2, slack_us=slack))
    first_may_start_at = clock.now + slack  # in the next window
    clock.now += 1
    second = store.acquire(key, WindowCall("fixed", rates, 2, slack_us=slack))
    # Then the next window does not see more than its limit start
    started = [(first_may_start_at, 2)] if first.allowed else []
    started += [(clock.now, 2)] if second.allowed else []
    assert max_units_per_aligned_window(started, period) <= 2, (first, second)


@pytest.mark.parametrize("pad_ms", [SCRIPT_POLICY.state_ttl_pad_ms, 300])
def test_state_gets_a_ttl_covering_every_counted_unit_then_expires(
    redis_client: redis.Redis, key_prefix: str, pad_ms: int
) -> None:
    # Given a clock frozen at the real time (TTLs are real milliseconds; frozen, no
    # window boundary can pass between the calls), short windows, and the scripts loaded
    # with the policy's TTL pad or another
    store = RedisStore(STORE_URL, key_prefix, clock=FakeClock(time.time_ns() // 1000),
                       policy=ScriptPolicy(state_ttl_pad_ms=pad_ms))
    rates = (Rate(2, 0.2),)  # 2 per 200 ms
    keys = {}
    try:
        for algorithm in ALGORITHMS:
            key = state_key(key_prefix, "ttl", algorithm)
            keys[algorithm] = key
            # When it admits two calls
            for _ in range(2):
                reply = store.acquire(key, WindowCall(algorithm, rates, 1, slack_us=2000))
                assert reply.allowed
            # Then the hash lives at least until the last counted unit leaves its window,
            # plus the pad it was loaded with, and at most one more window (the headroom a
            # TTL is grown by)
            pttl = redis_client.pttl(key)
            needed_ms = math.ceil((reply.clear_at_us - reply.now_us) / 1000) + pad_ms
            headroom_ms = 200
            assert needed_ms - 100 <= pttl <= needed_ms + headroom_ms, (algorithm, pttl, needed_ms)
        deadline = time.monotonic() + 3.0
        while any(redis_client.exists(k) for k in keys.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        # And once it has passed, nothing of the prefix is left
        assert list(redis_client.scan_iter(match=f"{key_prefix}:*")) == []
    finally:
        store.close()


def test_reset_forgets_every_window_of_a_key_and_keeps_its_line(redis_client: redis.Redis, key_prefix: str) -> None:
    from celery import Celery

    from celery_throttle.check.limiter import Throttle

    app = Celery("ct-model-check", set_as_current=False)
    throttle = Throttle(app, {"redis_url": STORE_URL, "key_prefix": key_prefix})
    try:
        # Given a key at its limit under two rates, a task waiting in its line, and
        # another key in use
        for _ in range(2):
            assert throttle.acquire("reset-scope", "tenant-a", ["2/m", "5/h"]).allowed
        assert throttle.acquire("reset-scope", "tenant-b", ["2/m"]).allowed
        assert not throttle.acquire("reset-scope", "tenant-a", ["2/m", "5/h"]).allowed
        key = state_key(key_prefix, "reset-scope", "tenant-a")
        call = throttle.checker.finish_bind(throttle._direct_call("reset-scope", "tenant-a", ["2/m", "5/h"], 1, None),
                                            None)
        queued = throttle.checker.acquire(call, entry=entry())
        assert queued.code == Code.QUEUED
        throttle.lines.handle(call, queued)  # (the index hears of the line)
        # When the first key is reset
        assert throttle.reset("reset-scope", "tenant-a") is True
        # Then its windows are gone, its line is not, and its task is released at once
        # by a look the reset asked for (the index says now)
        assert redis_client.hlen(key) == 0
        assert redis_client.zcard(window_keys(key)[2]) == 1
        due = redis_client.zscore(f"{key_prefix}:{{lines}}:due", key)
        assert due is not None and due <= throttle.store.now_us()
        released = throttle.checker.release(call, 8)
        assert [r.kind for r in released.reported] == ["r"]
        # and the other key is untouched
        assert throttle.status("reset-scope", "tenant-b").remaining == 1
    finally:
        throttle.store.close()


def test_sliding_day_limit_memory_stays_flat_after_5000_admissions(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis
) -> None:
    # Given a sliding 100000/d limit
    rates = rates_of(["100000/d"])
    key = state_key(store.prefix, "memory", "t")
    step = int(1.5 * 86_400_000_000 / 5000)  # 5000 admissions spread over a day and a half
    worst = 0
    for i in range(5000):
        # When each admission comes some 26 s after the last
        clock.now += step
        assert store.acquire(key, WindowCall("sliding", rates, 1, slack_us=2000)).allowed
        if i % 250 == 249:
            worst = max(worst, redis_client.memory_usage(key, samples=0))
    # Then the hash keeps one field for the rate, holding one bucket per BUCKETS-th of the
    # day (a day's span touches at most BUCKETS + 1 of them), and its epoch field; under 4 kB
    assert sorted(redis_client.hkeys(key)) == [b"e", b"f", b"s100000/86400000000"]
    assert len(SlidingRate.decode(redis_client.hget(key, "s100000/86400000000"))) <= 2 * (BUCKETS + 1)
    assert worst < 4096, f"MEMORY USAGE reached {worst} bytes"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_admit_at_publish_records_nothing_for_a_key_with_room_and_releases_near_the_limit(
    store: RedisStore, clock: FakeClock, algorithm: str
) -> None:
    # Given an empty "10/m" key
    rates = rates_of(["10/m"])
    key = state_key(store.prefix, "admit", algorithm)
    call = WindowCall(algorithm, rates, 2)
    # When a call of cost 2 is admitted at publish, sent without its message (the
    # producer's budget of unchecked sends is not spent)
    first = store.admit(key, call, entry(b""))
    # Then it fits, nothing is recorded, and the room up to half the limit is 5 units
    assert (first.code, first.leased) == (Code.RUN, 5)
    assert store.peek(key, call).remaining == 10
    # And one sent with its message (that budget spent: a queue that fills while no
    # worker runs) is counted: it leaves released, its units out
    sent = entry()
    counted = store.admit(key, call, sent)
    assert (counted.code, counted.out) == (Code.RELEASED, 1)
    assert store.give_back(key, call, sent.id, 8).out == 0
    # And once 4 units are counted, a call of 2 would pass half the limit: it leaves
    # released, its units out (set beside the window's until it starts)
    for _ in range(2):
        assert store.acquire(key, call).allowed
    near = store.admit(key, call, entry())
    assert (near.code, near.out) == (Code.RELEASED, 1)
    assert store.peek(key, call).remaining == 4
    # And past the room, a call waits in the line (its message kept)
    for _ in range(2):
        assert store.admit(key, call, entry()).code == Code.RELEASED
    assert store.admit(key, call, entry()).code == Code.QUEUED


def test_a_lease_or_publish_near_a_fixed_windows_end_looks_at_the_next_window_too(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis
) -> None:
    # Given a fixed "50/s" key whose window holds 5 units and the next one 25 (reserved
    # starts), and the clock 10 ms before the window ends
    rates, period = rates_of(["50/s"]), 1_000_000
    k = BASE_US // period + 5
    clock.now = (k + 1) * period - 10_000
    keys = [state_key(store.prefix, "fixed-next", name) for name in ("publish", "lease")]
    for key in keys:
        redis_client.hset(key, mapping={rate_field("fixed", rates[0]): msgpack.packb([k, 5, k + 1, 25]),
                                        "e": str(BASE_US), "f": str(STATE_FORMAT)})
    call = WindowCall("fixed", rates, 1, slack_us=20_000)
    # When a call sent without its message is admitted at publish (its slack reaches into
    # the next window), and a fresh call asks for a lease of 10 over 50 ms
    published = store.admit(keys[0], call, entry(b""))
    leased = store.acquire(keys[1], call, lease=10, lease_span_us=50_000)
    # Then neither takes room past half the limit of the next window: publish releases it
    # (it fits, but 26 of 50 is past half), and the call runs alone, without a lease
    assert published.code == Code.RELEASED
    assert (leased.code, leased.leased) == (Code.RUN, 0)
    assert redis_client.hget(keys[1], rate_field("fixed", rates[0])) == msgpack.packb([k, 6, k + 1, 26])
