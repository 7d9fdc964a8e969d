"""Fixtures of the script tier's model checks: a client of the tests' store, and a key
prefix of a test's own whose keys are deleted after it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.helpers import STORE_URL, redis_or_skip


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
