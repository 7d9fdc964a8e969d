"""What a store far away pays: one round trip where a read needs one (every round trip to a
store 100 ms away is 100 ms of a task's start: bench section 13). Round trips are counted
on the store's own client, each command it sends, against a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery

import celery_throttle
from celery_throttle.core.keys import state_key
from celery_throttle.core.protocol import Code, Entry, WindowCall
from celery_throttle.core.rates import parse_rate
from celery_throttle.core.state import CONTROL_STAMP
from celery_throttle.store.client import RedisStore
from tests.helpers import STORE_URL
from tests.line_walk import FakeClock

BASE_US = 1_700_000_000_000_000


@contextmanager
def commands_sent(client: redis.Redis) -> Iterator[list[str]]:
    """The commands ``client`` sends meanwhile (a pipeline's would count as one: none here)."""
    sent: list[str] = []
    send = client.execute_command

    def counted(*args: Any, **options: Any) -> Any:
        sent.append(str(args[0]))
        return send(*args, **options)

    client.execute_command = counted  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        del client.execute_command


@pytest.fixture
def ctl(prefix: str, store_client: redis.Redis) -> celery_throttle.Throttle:
    return celery_throttle.install(Celery("far", broker="memory://", set_as_current=False),
                                   redis_url=STORE_URL, key_prefix=prefix)


def test_a_control_hash_no_write_stamped_comes_whole_with_its_stamps_read(
        ctl: celery_throttle.Throttle, store_client: redis.Redis, prefix: str) -> None:
    def in_force() -> list[str]:
        return [str(r) for r in ctl.checker.controls.rates_for(ctl.store, "vendor", None, ())]

    # Given no control ever set (the usual case): a refresh is one round trip
    with commands_sent(ctl.store._redis) as sent:
        ctl.checker.refresh_controls()
    assert sent == ["EVAL"] and in_force() == []
    # Given a live limit written by hand, no stamp: one round trip, and it is in force
    store_client.hset(f"{prefix}:control", "limit:vendor", "3/s")
    with commands_sent(ctl.store._redis) as sent:
        ctl.checker.refresh_controls()
    assert sent == ["EVAL"] and in_force() == ["3/s"]
    # Given a stamped hash whose stamp moved (another process's write): the stamp, then the hash
    store_client.hset(f"{prefix}:control", mapping={"limit:vendor": "5/s", CONTROL_STAMP: "1"})
    with commands_sent(ctl.store._redis) as sent:
        ctl.checker.refresh_controls()
    assert sent == ["EVAL", "HGETALL"] and in_force() == ["5/s"]
    # and whose stamp did not: the stamp alone
    with commands_sent(ctl.store._redis) as sent:
        ctl.checker.refresh_controls()
    assert sent == ["EVAL"] and in_force() == ["5/s"]


def test_a_lines_message_is_sampled_in_one_round_trip_head_first(key_prefix: str) -> None:
    # Given a key of 1/s: A runs, B and C wait (a releaser that knows no task of the line
    # reads a message of it to bind the release's call)
    clock = FakeClock(BASE_US)
    store = RedisStore(STORE_URL, key_prefix, clock=clock)
    call = WindowCall("sliding", (parse_rate("1/s"),), 1, slack_us=10_000)
    key = state_key(key_prefix, "far", "sample")
    try:
        codes = [store.acquire(key, call, entry=Entry(f"{n}:x", f"message {n}".encode(), n, 0, 0, 8)).code
                 for n in "ABC"]
        assert codes == [Code.RUN, Code.QUEUED, Code.QUEUED]
        with commands_sent(store._redis) as sent:
            assert store.sample(key) == b"message B"
        assert sent == ["EVAL"]
        # When B is released (out, not started): the line's head comes first
        clock.now += 1_100_000
        assert [r.id for r in store.release(key, call, 64).reported] == ["B:x"]
        assert store.sample(key) == b"message C"
        # and with the line empty (C purged), the task released and not started
        store.drop(key, call, ["C:x"])
        assert store.sample(key) == b"message B"
        # and a key with nothing: none
        assert store.sample(state_key(key_prefix, "far", "nothing")) is None
    finally:
        store.close()
