"""Soak: tens of thousands of tasks across tenants through several worker processes.

Bounded: 20 000 tasks, 40 tenants, at most 5 minutes. Nothing lost, nothing run twice,
no window broken, and no window state left once the keys' TTLs have passed.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import pytest

from celery_throttle.core.timing import SCRIPT_POLICY
from tests.helpers import WorkerGroup, max_started_in, max_started_in_aligned, wait_for

TENANTS = 40
PER_TENANT = 500
RATE = 25  # per second, per tenant: the 40 tenants together ask for 1000/s


@pytest.mark.soak
def test_soak_twenty_thousand_tasks_across_tenants(workers: WorkerGroup, broker_url: str) -> None:
    if "amqp" in broker_url:
        pytest.skip("the soak runs once, on the Redis broker")
    label = f"soak-{time.time_ns()}"
    tenants = [f"tenant-{n}" for n in range(TENANTS)]
    # Given 20 000 tasks sent at once, half on sliding and half on fixed windows
    ids = []
    for _ in range(PER_TENANT):
        for n, tenant in enumerate(tenants):
            task = "soak_sliding" if n % 2 == 0 else "soak_fixed"
            ids.append(workers.send(task, label, tenant, f"{RATE}/s"))
    # When they have all run
    wait_for(lambda: len(workers.starts(label)) >= len(ids), 300, 1.0, "every soak task")
    time.sleep(2)
    starts = workers.starts(label)
    # Then none was lost or run twice
    counts = Counter(e["id"] for e in starts)
    assert set(counts) == set(ids)
    assert max(counts.values()) == 1
    # And no tenant's window was broken
    by_tenant = defaultdict(list)
    for e in starts:
        by_tenant[e["tenant"]].append(e["t"])
    for n, tenant in enumerate(tenants):
        if n % 2 == 0:
            assert max_started_in(by_tenant[tenant], 1.0) <= RATE, tenant
        else:
            assert max_started_in_aligned(by_tenant[tenant], 1.0) <= RATE, tenant
    # And once the TTLs have passed, no window state is left in Redis. What a key's line
    # remembers of the entries that started (`:used`, a copy of one is dropped) outlives
    # them by design, USED_KEEP_MS: a key has it when a task of it waited in its line (as
    # many do when the producer outruns 25/s a tenant), with its TTL (the fixture deletes it)
    def state_left() -> list[bytes]:
        return [k for k in workers.store_client.scan_iter(match=f"{workers.prefix}:{{soak-*", count=1000)
                if not k.endswith(b":used")]
    wait_for(lambda: not state_left(), 10, 0.5, "window state to expire")
    used = list(workers.store_client.scan_iter(match=f"{workers.prefix}:{{soak-*:used", count=1000))
    assert all(0 < workers.store_client.pttl(k) <= SCRIPT_POLICY.used_keep_ms for k in used)
