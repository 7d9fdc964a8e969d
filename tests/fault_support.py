"""What the fault tests share (tests/faults/): workers of a test's own, started and
stopped by the test (``group_factory``), a fresh prefix, the check that every task ran
once, and the noise allowed between a start and its body."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

from tests.conftest import _clean
from tests.helpers import BROKER_URL, STORE_URL, WorkerGroup, delete_queues

#: The skew test's clocks are 2 and 3 s off: a start counted on a worker's own clock would
#: land seconds out of place, so the test loses nothing by allowing a quarter second of noise
#: between a start and its body. A CI run beside three other suites reached two bodies 70 ms
#: further apart than their starts, past BODY_NOISE and the 2 % margin together. (The
#: killed-worker test reads body times too, and allows the same.)
SKEW_NOISE = 0.25


def new_prefix() -> str:
    return f"ct-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def group_factory(store_client: redis.Redis) -> Iterator:
    groups: list[WorkerGroup] = []

    def make(**kwargs) -> WorkerGroup:
        kwargs.setdefault("prefix", new_prefix())
        kwargs.setdefault("broker", BROKER_URL)
        kwargs.setdefault("store", STORE_URL)
        group = WorkerGroup(**kwargs)
        groups.append(group)
        return group

    yield make
    for group in groups:
        group.stop()
        _clean(store_client, group.prefix)
        delete_queues(group.broker, group.queues)


def ran_once(group: WorkerGroup, label: str, ids: list[str]) -> list[dict]:
    starts = group.starts(label)
    counts = Counter(e["id"] for e in starts)
    assert set(counts) == set(ids), f"lost: {set(ids) - set(counts)}"
    assert max(counts.values()) == 1, f"ran twice: {[i for i, n in counts.items() if n > 1]}"
    return starts
