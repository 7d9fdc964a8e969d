"""Fixtures of the script tier's model checks: a client of the tests' store, a key prefix
of a test's own whose keys are deleted after it, a clock the tests set, and a store on it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_throttle.store.client import RedisStore
from tests.helpers import STORE_URL, redis_or_skip
from tests.line_walk import FakeClock

#: A plausible "now": late 2023 in µs, well below 2**53.
BASE_US = 1_700_000_000_000_000


@pytest.fixture(scope="module")
def redis_client() -> Iterator[redis.Redis]:
    client = redis_or_skip(STORE_URL)
    yield client
    client.close()


@pytest.fixture
def key_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A prefix of this test's own; every key under it is deleted afterwards."""
    prefix = f"ct-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    for key in redis_client.scan_iter(match=f"{prefix}:*", count=1000):
        redis_client.delete(key)


@pytest.fixture
def clock() -> FakeClock:
    """Now, in µs, as the test says; passed to the scripts as ARGV[1]."""
    return FakeClock(BASE_US)


@pytest.fixture
def store(redis_client: redis.Redis, key_prefix: str, clock: FakeClock) -> Iterator[RedisStore]:
    s = RedisStore(STORE_URL, key_prefix, clock=clock)
    yield s
    s.close()
