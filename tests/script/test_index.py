"""The index of keys with a line (index.lua), on a real Redis with a test clock: the newest
computation of a key's due time wins, and a wake-up (a resume, a raised limit) is never
undone by a due time computed under controls read before it.

The race this holds: a releaser whose process read the controls while a pause was on
claims a key, the pause is resumed and the key woken, and the releaser settles the key at
the pause's end, computed after the wake-up (so newer) but under the old controls. Before,
that settle won and the tasks the resume freed waited out the pause (a full suite saw 6
tasks start 11 s after a resume, at the pause's end).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_throttle.core.keys import line_index_key
from celery_throttle.store.client import RedisStore
from tests.helpers import STORE_URL, redis_or_skip

BASE = 1_800_000_000_000_000
SECOND = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = BASE

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def world() -> Iterator[tuple[RedisStore, Clock, str]]:
    client = redis_or_skip(STORE_URL)
    clock, prefix = Clock(), f"ct-test-{uuid.uuid4().hex[:10]}"
    store = RedisStore(STORE_URL, prefix, clock=clock)
    yield store, clock, f"{prefix}:{{scope:acme}}"
    store.close()
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


def _due(store: RedisStore, key: str) -> float | None:
    with redis.Redis.from_url(STORE_URL) as client:
        return client.zscore(line_index_key(store.prefix), key)


@pytest.mark.parametrize("fresh_controls", [False, True], ids=["read-before-the-wake", "read-after-it"])
def test_a_settle_under_controls_read_before_a_wake_up_never_pushes_the_look_later(
        world: tuple[RedisStore, Clock, str], fresh_controls: bool) -> None:
    store, clock, key = world
    pause_end = BASE + 12 * SECOND
    # Given a key due at its pause's end, and a releaser that read its controls then
    store.index_note(key, pause_end, BASE, BASE)
    read_at = clock.now
    clock.now += 100_000
    _, _, claimed = store.index_claim(20 * SECOND, 10, 10 * SECOND)
    assert [k for k, _ in claimed] == [key]
    token = claimed[0][1]
    # When the pause is resumed and the key woken
    clock.now += 100_000
    assert store.index_wake([key]) == 1
    woke_at = clock.now
    # And the releaser, having read its controls before the wake-up (or after it), settles
    # the key at the pause's end, a computation newer than the wake-up
    clock.now += 100_000
    store.index_settle([(key, token, pause_end, clock.now, clock.now if fresh_controls else read_at)])
    # Then the key is due at once for a look under the controls as they are, unless the
    # releaser had read them after the wake-up (then its due time holds)
    assert _due(store, key) == (pause_end if fresh_controls else clock.now)
    assert _due(store, key) <= pause_end and woke_at < clock.now


def test_a_note_under_controls_read_before_a_wake_up_may_bring_the_look_earlier_not_later(
        world: tuple[RedisStore, Clock, str]) -> None:
    store, clock, key = world
    store.index_note(key, BASE + 12 * SECOND, BASE, BASE)
    clock.now += SECOND
    store.index_wake([key])
    woke = clock.now
    clock.now += SECOND
    # (a call whose process read its controls before the wake-up)
    assert not store.index_note(key, BASE + 12 * SECOND, clock.now, BASE)
    assert _due(store, key) == woke
    assert store.index_note(key, woke - 1, clock.now, BASE)
    assert _due(store, key) == woke - 1
    # (one that read them after it is news as always)
    assert store.index_note(key, BASE + 30 * SECOND, clock.now + 1, clock.now)
    assert _due(store, key) == BASE + 30 * SECOND


def test_a_key_that_leaves_the_index_forgets_its_wake_up(world: tuple[RedisStore, Clock, str]) -> None:
    store, clock, key = world
    store.index_note(key, BASE + SECOND, BASE, BASE)
    store.index_wake([key])
    clock.now += SECOND
    _, _, claimed = store.index_claim(0, 10, 10 * SECOND)
    store.index_settle([(key, claimed[0][1], 0, clock.now, clock.now)])
    with redis.Redis.from_url(STORE_URL) as client:
        assert client.zscore(line_index_key(store.prefix), key) is None
        assert not client.hexists(f"{line_index_key(store.prefix)[:-len(':due')]}:at", f"{key}#w")


def test_a_line_that_begins_while_a_releaser_that_knows_none_of_its_tasks_looks_stays_in_the_index(
        prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Celery

    import celery_throttle
    from celery_throttle.core.protocol import Code, Entry

    # Given a key under 1/h whose window is spent and whose line just emptied (the index
    # has it due now), claimed by a releaser whose process knows none of its tasks
    clock = [BASE]
    app = Celery(f"index-race-{prefix}", set_as_current=False)
    releasing, producing = (celery_throttle.Throttle(app, {"redis_url": STORE_URL, "key_prefix": prefix},
                                                     clock=lambda: clock[0]) for _ in range(2))
    call = producing._direct_call("exports", "acme", "1/h", 1, None)
    assert producing.checker.acquire(call).allowed
    store = releasing.setup.store
    store.index_note(call.state_key, BASE, BASE)
    clock[0] += 1_000
    _, _, claimed = store.index_claim(2_000, 32, 10 * SECOND)
    assert [key for key, _ in claimed] == [call.state_key]
    # When a producer's task begins the line between the releaser's read of its counts and
    # the rest of its look (the producer notes the index as its script ends)
    counts, noted = store.line_counts, []

    def counts_then_a_producer(key: str) -> tuple[int, int]:
        read = counts(key)
        clock[0] += 1_000
        waits = producing.checker.acquire(call, entry=Entry("t:1", b"m", "t", 0, 0, 1))
        assert waits.code == Code.QUEUED
        producing.lines.handle(call, waits)
        noted.append(waits.due_us)
        clock[0] += 1_000
        return read

    monkeypatch.setattr(store, "line_counts", counts_then_a_producer)
    try:
        due, at = releasing.lines.release(call.state_key)
        store.index_settle([(call.state_key, claimed[0][1], due, at, 0)])
        # Then the index keeps the key, due when the producer's script said: the releaser's
        # look (the line empty) is older than the producer's note, and cannot undo it
        assert noted and _due(store, call.state_key) == noted[0] > clock[0]
    finally:
        releasing.close()
        producing.close()


@pytest.mark.parametrize("index_parts", [1, 2], ids=["one-redis", "index-split-as-on-a-cluster"])
def test_a_line_whose_callers_reply_was_lost_is_in_the_index_without_the_sweep(prefix: str, index_parts: int) -> None:
    from celery_throttle.core.errors import StoreError
    from celery_throttle.core.protocol import Code, Entry, WindowCall, WindowReply
    from celery_throttle.core.rates import parse_rate

    # Given a key of 1/s whose room is used
    clock = Clock()
    store = RedisStore(STORE_URL, prefix, clock=clock, index_parts=index_parts)
    call = WindowCall("sliding", (parse_rate("1/s"),), 1, slack_us=10_000)
    key, other = f"{prefix}:{{scope:acme}}", f"{prefix}:{{scope:other}}"
    real_run = store.run
    try:
        assert store.acquire(key, call).code == Code.RUN
        # When a task joins its line, and the script runs but its reply never reaches the
        # caller (a dropped link; or the caller dies there), so the caller notes nothing
        lost: list[WindowReply] = []

        def reply_lost(script: str, keys: list[str], args: list[object]) -> None:
            del store.run
            lost.append(WindowReply.of(real_run(script, keys, args)))
            raise StoreError("the reply was lost")

        store.run = reply_lost  # type: ignore[method-assign]
        with pytest.raises(StoreError):
            store.acquire(key, call, entry=Entry("t:1", b"m", "t", 0, 0, 1))
        with redis.Redis.from_url(STORE_URL) as client:
            assert client.zcard(f"{key}:line") == 1
        # (a split index, a Redis Cluster's: the caller tells it, once the store answers again)
        clock.now += 1_000
        store.acquire(other, call)
        # Then the index has the key, due when the lost reply said (one store, where the
        # script tells the index itself) or now (the caller that lost the reply tells it so)
        due = store._redis.zscore(store.index_keys(store.index_part(key))[0], key)
        assert lost[0].due_us > BASE
        assert due == (lost[0].due_us if index_parts == 1 else BASE + 1_000), due
    finally:
        store.close()
