"""A fair share of a scope's slots with real workers (tests.taskapp.shared_slots: K=4 for
the scope, tenants weighing 1, "heavy" 2), on 2 prefork workers of 3 processes (6, more
than K: the share binds, not the pool). Tasks are sent by a producer process that imports
the tasks module, into a queue no worker reads yet; the workers start after.

- Three tenants flooding share the starts 1:1:2 while all wait, never more than 4 at once;
  ``throttle status`` shows each key's cap of the scope's K.
- A tenant alone runs 4 at once; one that comes while it floods starts long before the
  flood ends (within about a body: no body is stopped to make room).
- One-off tenants coming one after another beside a flood do not hold its slots idle.
- A worker that stops mid-batch leaves the sharing to the other: every task runs, once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

from tests.conftest import _clean
from tests.helpers import BROKER_URL, STORE_URL, WorkerGroup, delete_queues, new_label, run_cli, wait_for
from tests.workers.test_concurrency import most_at_once, spans, wait_spans

K = 4
BODY = 0.3


@pytest.fixture
def group(store_client: redis.Redis) -> Iterator[WorkerGroup]:
    group = WorkerGroup(prefix=f"ct-test-share-{uuid.uuid4().hex[:8]}", broker=BROKER_URL, store=STORE_URL,
                        pool="prefork", count=2, concurrency=3)
    try:
        yield group
    finally:
        group.stop()
        _clean(store_client, group.prefix)
        delete_queues(BROKER_URL, group.queues)


def flood(group: WorkerGroup, label: str, counts: dict[str, int]) -> list[str]:
    """A producer process sends ``counts`` tasks per tenant, interleaved by weight."""
    plan, left = [], dict(counts)
    while any(left.values()):
        for tenant in counts:
            for _ in range(2 if tenant == "heavy" else 1):
                if left[tenant]:
                    left[tenant] -= 1
                    plan.append({"how": "delay", "task": "shared_slots", "args": [label, tenant, BODY], "count": 1})
    sent = group.produce(*plan, timeout=300)
    return [i for ids in sent["sent"] for i in ids]


@pytest.mark.any_store
def test_tenants_share_the_slots_by_weight(group: WorkerGroup) -> None:
    # Given a backlog of three tenants (weights 1:1:2), sent while no worker runs
    label = new_label()
    ids = flood(group, label, {"a": 40, "b": 40, "heavy": 80})
    # When the workers start
    group.start()
    wait_for(lambda: len(spans(group, label)) >= 12, 60, 0.05, "the flood under way")
    # (the operators see each key's cap in the share, of the scope's K)
    shown = json.loads(run_cli(group, "status", "shared-slots", "--key", "heavy", "--json").stdout)["keys"][0]
    assert shown["concurrency"] == K and 1 <= shown["share_cap"] <= K, shown
    table = run_cli(group, "status", "shared-slots").stdout
    assert f" of {K}" in table and "the key's cap in its scope's share" in table, table
    done = wait_spans(group, label, len(ids), timeout=120)
    # Then each ran once, never more than K of the scope at once, and K at once they did
    assert sorted(e["id"] for e in done) == sorted(ids)
    assert most_at_once(done) == K
    # and while all three waited (until the first tenant's last start), the starts went 1:1:2
    last = min(max(e["t0"] for e in done if e["tenant"] == t) for t in ("a", "b", "heavy"))
    first = min(e["t0"] for e in done)
    window = [e for e in done if first + 1.0 <= e["t0"] <= last]  # (the first second: caps being set)
    counts = {t: sum(1 for e in window if e["tenant"] == t) for t in ("a", "b", "heavy")}
    total = sum(counts.values())
    assert total >= 40, counts
    for tenant, weight in (("a", 0.25), ("b", 0.25), ("heavy", 0.5)):
        assert abs(counts[tenant] / total - weight) <= 0.15 * weight, counts


def test_a_tenant_alone_uses_every_slot_and_a_newcomer_starts_within_a_body(group: WorkerGroup) -> None:
    # Given one tenant's flood of 80 bodies of 0.3 s (6 s on 4 slots), sent before the workers start
    label = new_label()
    ids = flood(group, label, {"solo": 80})
    group.start()
    wait_for(lambda: len(spans(group, label)) >= 12, 60, 0.05, "the flood under way")
    # When another tenant sends one task while the flood runs
    sent_at = time.time()
    late = group.send("shared_slots", label, "late", BODY)
    done = wait_spans(group, label, len(ids) + 1, timeout=120)
    # Then the flood ran K at once (every slot), and the newcomer did not wait for the flood
    solo = [e for e in done if e["tenant"] == "solo"]
    assert most_at_once(solo) == K and most_at_once(done) == K
    newcomer = next(e for e in done if e["id"] == late)
    flood_end = max(e["t0"] for e in solo)
    assert newcomer["t0"] < flood_end - 1.0, (newcomer["t0"] - sent_at, flood_end - sent_at)
    assert newcomer["t0"] - sent_at <= 2.0  # (a body's end and a pass: 0.3 s and a few ms, unloaded)


def test_one_off_tenants_beside_a_flood_do_not_hold_its_slots_idle(group: WorkerGroup) -> None:
    """A new tenant every 0.5 s sends one task of 50 ms while another floods: each one-off
    starts within about a body of the flood, and its slot goes back to the flood within
    about as long as it held it. (When a key that had just run kept its slot a whole
    second, the flood ran 2.2 of the 4 at once here; 3.6 now.)"""
    label = new_label()
    ids = flood(group, label, {"solo": 60})
    group.start()
    wait_for(lambda: len(spans(group, label)) >= K, 60, 0.05, "the flood under way")
    one_offs = group.produce(*({"how": "delay", "task": "shared_slots", "args": [label, f"one{i}", 0.05],
                                "after": 0.5} for i in range(12)), timeout=60)
    ones = [i for sent in one_offs["sent"] for i in sent]
    done = wait_spans(group, label, len(ids) + len(ones), timeout=120)
    assert sorted(e["id"] for e in done) == sorted(ids + ones) and most_at_once(done) <= K
    solo = [e for e in done if e["tenant"] == "solo"]
    first, last = min(e["t0"] for e in solo), max(e["t1"] for e in solo)
    running = sum(e["t1"] - e["t0"] for e in solo) / (last - first)
    assert running >= 2.8, f"the flood ran {running:.2f} of {K} at once on average"


def test_a_worker_that_stops_mid_batch_leaves_the_sharing_to_the_other(group: WorkerGroup) -> None:
    # Given two tenants' backlog
    label = new_label()
    ids = flood(group, label, {"a": 30, "heavy": 60})
    group.start()
    wait_for(lambda: len(spans(group, label)) >= 10, 60, 0.05, "the batch under way")
    # When one worker stops (warm shutdown: its bodies end, its locks are given back or run out)
    proc = group.procs[0]
    proc.terminate()
    # (About 2.5 s; once in some 25 runs beside three CPU hogs on 2 cores it took over 30.)
    proc.wait(60)
    # Then the other runs the rest, every task, never more than K at once. One may run
    # twice only where the broker gave its message back: Celery's warm shutdown can leave a
    # task that started unacked (celery/celery#3796), and a redelivered copy of a task that
    # started is run again (the hook's at-least-once choice: its process may have died
    # before the body). (Twice in full runs on 2026-12-05 a task ran twice here, the
    # second time with no copy redelivered; not seen since a5805ac: see its message.)
    wait_for(lambda: {e["id"] for e in spans(group, label)} >= set(ids), 120, 0.1, "every task run")
    time.sleep(1.0)
    done = spans(group, label)
    twice = [i for i, n in Counter(e["id"] for e in done).items() if n > 1]
    assert {e["id"] for e in done} == set(ids)
    assert all(any(e["redelivered"] for e in done if e["id"] == i) for i in twice), (
        [e for e in done if e["id"] in twice], proc.pid, group.log_text()[-20000:])
    assert most_at_once(done) <= K
