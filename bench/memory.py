"""Section 7: Redis memory per key, by limit, and per tenant.

Windows are filled until they deny (``limit`` calls of cost 1):

* "burst": every call now, so the sliding window's entries share one bucket;
* "spread": the calls evenly over the whole window, on a simulated clock (the
  controller's test clock), so every bucket a window can have is in use: the worst case.

The naive sliding log is filled the same way (one ZSET member per call) for comparison.
Bulk fills go through pipelines (bench/bulk.py) when the store's internals allow it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery import Celery

import celery_throttle
from bench.bulk import Bulk, supported
from bench.common import BROKER_URL, STORE_URL, Results, delete_prefix, fmt_bytes, store_client, used_memory
from bench.naive import NaiveLimiter
from celery_throttle.check.limiter import Throttle
from celery_throttle.core.keys import state_key

SLIDING_CAP = 4096  # "a few KB": the sliding window's bound whatever the limit
DAY = 86400


def _controller(prefix: str, clock: Callable[[], int] | None = None) -> Any:
    app = Celery("bench-mem", broker=BROKER_URL, set_as_current=False)
    overrides = {"redis_url": STORE_URL, "key_prefix": prefix}
    if clock is None:
        return celery_throttle.install(app, **overrides)
    return Throttle(app, overrides, clock=clock)


def _fill(ctl: Any, calls: Callable[[], None]) -> None:
    if supported(ctl.store):
        with Bulk(ctl.store, batch=1000):
            calls()
    else:
        calls()


def _window_memory(client: Any, ctl: Any, prefix: str, algo: str, limit: int, spread: bool,
                   sim: list[int]) -> tuple[int, bool]:
    """Fill one window of ``limit``/day; returns (MEMORY USAGE, whether it then denies)."""
    scope, key = "mem", f"{algo}-{limit}-{'spread' if spread else 'burst'}"
    rate = f"{limit}/d"
    t0 = sim[0]

    def calls() -> None:
        for i in range(limit):
            if spread:
                sim[0] = t0 + int(i * DAY * 1e6 / limit)
            ctl.acquire(scope, key=key, rates=rate, cost=1, algorithm=algo)

    _fill(ctl, calls)
    full = not ctl.acquire(scope, key=key, rates=rate, cost=1, algorithm=algo).allowed
    usage = client.memory_usage(state_key(prefix, scope, key), samples=0) or 0
    return int(usage), full


def run_memory(res: Results, prefix: str, limits: tuple[int, ...], tenants: int) -> None:
    client = store_client()
    sec = "7 memory"
    ctl = _controller(prefix)
    sim = [0]
    try:
        sim_ctl = _controller(prefix, clock=lambda: sim[0])
    except TypeError:  # the test clock is gone: no spread fill
        sim_ctl = None
        res.notes.append("memory: Throttle(clock=...) unavailable; spread fill skipped")
    naive = NaiveLimiter(client, "sliding")
    worst_sliding = 0
    for limit in limits:
        for algo in ("sliding", "fixed"):
            modes = [False] + ([True] if algo == "sliding" and sim_ctl is not None else [])
            for spread in modes:
                now_us = int(time.time() * 1e6)
                sim[0] = now_us - (DAY * 1_000_000 if spread else 0)
                use_ctl = sim_ctl if spread else ctl
                usage, full = _window_memory(client, use_ctl, prefix, algo, limit, spread, sim)
                name = f"{algo}{' (spread over the day)' if spread else ''}"
                if algo == "sliding":
                    worst_sliding = max(worst_sliding, usage)
                    res.add(sec, f"bytes/key at {limit}/d", name, fmt_bytes(usage),
                            f"<= {fmt_bytes(SLIDING_CAP)}", usage <= SLIDING_CAP and full,
                            "" if full else "window did not fill")
                else:
                    res.add(sec, f"bytes/key at {limit}/d", name, fmt_bytes(usage), "", None,
                            "" if full else "window did not fill")
        key = f"{prefix}:naive-log-{limit}"
        pipe = client.pipeline(transaction=False)
        for i in range(limit):
            naive.queue(pipe, key, limit, DAY, member=f"m{i}")
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()
        res.add(sec, f"bytes/key at {limit}/d", "naive sliding log",
                fmt_bytes(client.memory_usage(key, samples=0) or 0))
        client.unlink(key)
    delete_prefix(client, f"{prefix}:{{mem:")

    for algo in ("sliding", "fixed", "naive sliding log"):
        time.sleep(0.5)  # let lazy frees of the previous run settle
        before = used_memory(client)
        if algo == "naive sliding log":
            pipe = client.pipeline(transaction=False)
            for i in range(tenants):
                naive.queue(pipe, f"{prefix}:naive-tenant:{i}", 10, DAY, member="m")
                if i % 1000 == 999:
                    pipe.execute()
            pipe.execute()
            sample = [f"{prefix}:naive-tenant:{i}" for i in range(0, tenants, max(tenants // 200, 1))]
            match = f"{prefix}:naive-tenant:"
        else:
            scope = f"tenants-{algo}"

            def calls(a: str = algo, s: str = scope) -> None:
                for i in range(tenants):
                    ctl.acquire(s, key=f"t{i}", rates="10/d", cost=1, algorithm=a)

            _fill(ctl, calls)
            sample = [state_key(prefix, scope, f"t{i}") for i in range(0, tenants, max(tenants // 200, 1))]
            match = f"{prefix}:{{{scope}:"
        after = used_memory(client)
        per_tenant = (after - before) / tenants
        usages = [client.memory_usage(k, samples=0) or 0 for k in sample]
        mean_usage = sum(usages) / max(len(usages), 1)
        res.add(sec, f"bytes/tenant, {tenants:,} tenants at 10/d", algo,
                f"{per_tenant:.0f} B", "", None,
                f"INFO used_memory delta / tenants (whole server); MEMORY USAGE {mean_usage:.0f} B")
        delete_prefix(client, match)
    if worst_sliding:
        res.series["memory_worst_sliding"] = worst_sliding
