"""The index of keys with a line, and a shared scope's registry, in parts (store/index.py), as
on a Redis Cluster: here on one Redis with the index split in 3, so that every part's key is
read directly. Each key is noted, woken, claimed, settled and swept in its own part; the
operators' reads see every part; a wake-up names its part, and one that names none (or a
process of an earlier version's) wakes every part. On a real cluster the tags spread over
the masters (tests/faults/test_store_faults.py runs the workers on one)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from celery_throttle.core.keys import line_index_key, share_registry_key, window_keys
from celery_throttle.store.client import RedisStore
from celery_throttle.store.index import CLUSTER_INDEX_PARTS, index_tags
from tests.helpers import STORE_URL, redis_or_skip

PARTS = 3
BASE = 1_800_000_000_000_000
SECOND = 1_000_000


@pytest.fixture
def split() -> Iterator[tuple[RedisStore, redis.Redis]]:
    client = redis_or_skip(STORE_URL)
    prefix = f"ct-test-{uuid.uuid4().hex[:10]}"
    store = RedisStore(STORE_URL, prefix, clock=lambda: BASE, index_parts=PARTS)
    yield store, client
    store.close()
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


@pytest.mark.parametrize("parts", [2, 3, CLUSTER_INDEX_PARTS, 16])
def test_the_parts_tags_are_distinct_and_each_in_its_own_share_of_the_slots(parts: int) -> None:
    for first in ("lines", "#share"):
        tags = index_tags(parts, first)
        assert len(set(tags)) == parts
        width = REDIS_CLUSTER_HASH_SLOTS / parts
        assert [int(key_slot(t.encode()) // width) for t in tags] == list(range(parts))
    assert index_tags(1) == ("lines",) and index_tags(1, "#share") == ("#share",)


def test_each_key_is_noted_claimed_and_settled_in_its_own_part(split: tuple[RedisStore, redis.Redis]) -> None:
    store, client = split
    keys = [f"{store.prefix}:{{scope:t{i}}}" for i in range(30)]
    # Given 30 keys noted due now
    for key in keys:
        assert store.index_note(key, BASE, BASE, BASE)
    parts = {key: store.index_part(key) for key in keys}
    tags = index_tags(PARTS)
    # Then each is in its own part and no other, and every part holds some
    for key, part in parts.items():
        for other, tag in enumerate(tags):
            assert (client.zscore(line_index_key(store.prefix, tag), key) is not None) == (other == part)
    assert set(parts.values()) == set(range(PARTS))
    # And the operators' reads see every part
    assert sorted(store.indexed()) == sorted(keys) and store.lines_indexed() == 30
    # And a claim of a part takes that part's keys only; its settle leaves them there
    for part in range(PARTS):
        _, _, claimed = store.index_claim(0, 100, 10 * SECOND, part)
        assert sorted(k for k, _ in claimed) == sorted(k for k, p in parts.items() if p == part)
        _, first = store.index_settle([(k, token, BASE + 5 * SECOND, BASE, BASE) for k, token in claimed], part)
        assert first == BASE + 5 * SECOND
    # And a wake-up of keys in several parts brings each due now, in its own part
    assert store.index_wake(keys[:10]) == 10
    for part in range(PARTS):
        _, _, claimed = store.index_claim(0, 100, 10 * SECOND, part)
        assert sorted(k for k, _ in claimed) == sorted(k for k in keys[:10] if parts[k] == part)


def test_a_claim_settles_the_claimers_last_round_first(split: tuple[RedisStore, redis.Redis]) -> None:
    store, _ = split
    key = f"{store.prefix}:{{scope:one}}"
    part = store.index_part(key)
    store.index_note(key, BASE, BASE, BASE)
    _, _, claimed = store.index_claim(0, 10, 10 * SECOND, part)
    assert [k for k, _ in claimed] == [key]
    # When the next claim carries the key's settle (due in 5 s), it is written first: not
    # claimed now (not due), and the part's earliest look is its due
    _, first, again = store.index_claim(0, 10, 10 * SECOND, part, [(key, claimed[0][1], BASE + 5 * SECOND, BASE, BASE)])
    assert again == [] and first == BASE + 5 * SECOND
    # And one that settles it due now claims it again in the same call
    _, _, back = store.index_claim(0, 10, 10 * SECOND, part, [(key, 0, BASE, BASE + 1, BASE + 1)])
    assert [k for k, _ in back] == [key]


def test_a_line_missing_from_its_part_is_found_by_the_sweep(split: tuple[RedisStore, redis.Redis]) -> None:
    store, client = split
    indexed, missing = f"{store.prefix}:{{scope:here}}", f"{store.prefix}:{{scope:gone}}"
    for key in (indexed, missing):
        client.hset(window_keys(key)[1], "q", 1)  # (a line's counts: it has a line)
    store.index_note(indexed, BASE, BASE, BASE)
    assert list(store.unindexed_lines(1000) or []) == [missing]


def test_a_wake_up_names_its_part_and_one_that_names_none_wakes_every_part(
        split: tuple[RedisStore, redis.Redis]) -> None:
    store, client = split
    store.wake_releasers(2)
    assert store.wait_for_wake(1.0) == ({2: None}, False)
    # (a call that noted a look due later says when: the releaser waits for it)
    store.wake_releasers(1, BASE + SECOND)
    assert store.wait_for_wake(1.0) == ({1: BASE + SECOND}, False)
    # (a resume, a raised limit: every part, and the controls read again)
    store.wake_releasers()
    assert store.wait_for_wake(1.0) == ({0: None, 1: None, 2: None}, True)
    # (a process of an earlier version pushes 1: every part, not part 1)
    client.lpush(f"{store.prefix}:{{lines}}:wake", 1)
    assert store.wait_for_wake(1.0) == ({0: None, 1: None, 2: None}, True)
    assert store.wait_for_wake(0.05) is None


def test_a_shared_scopes_registry_keeps_each_key_in_its_part_and_reads_them_all(
        split: tuple[RedisStore, redis.Redis]) -> None:
    store, client = split
    keys = [f"{store.prefix}:{{api:t{i}}}" for i in range(12)]
    for i, key in enumerate(keys):
        store.share_join("api", key, 1.0 + i, 0)
    tags = index_tags(PARTS, "#share")
    for key in keys:
        held = [client.hexists(share_registry_key(store.prefix, "api", tag), key) for tag in tags]
        assert held == [part == store.index_part(key) for part in range(PARTS)]
    members = store.share_members("api")
    assert sorted(members) == sorted(keys) and members[keys[3]].weight == 4.0
    assert sorted(store.share_leave("api", {k: members[k] for k in keys[:5]})) == sorted(keys[:5])
    assert sorted(store.share_members("api")) == sorted(keys[5:])
