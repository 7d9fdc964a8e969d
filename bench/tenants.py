"""Section 46c (tenants, issue 46 item 4): the fair share at Celery's defaults, on the issue's shape.

``concurrency=6, share=True`` over a scope keyed by tenant, 2 workers x 3 prefork, bodies of
0.4 s, Celery's default prefetch; beside it per-key ``concurrency=2`` without a share, and plain
Celery. Each run at ``acks_late=True`` (the issue's) and at Celery's default (acks on receipt).

1. alone: one tenant's flood of :data:`ALONE` tasks sent before the workers start: the share of the 6
   slots its bodies use from 2 s after the first start to 2 s before the last end (target >= 0.95).
2. small tenants beside a flood: a flood of :data:`FLOOD` sent before the workers start; once 12 of
   its bodies began, :data:`SMALL` tenants send 1 to 3 tasks each (seeded), all at once. The flood's
   body time against what the small tenants leave (6 slots x from their send to their last end, less
   their body time; target >= 0.85), and their tasks' start after send, p50 / p95 (target: no longer
   than per-key caps).
"""

from __future__ import annotations

import random
import time
from typing import Any

from bench.app import TENANTS_K, TENANTS_PER_KEY
from bench.common import Results, after_send, md, percentile
from bench.share import Run, run

SEC, BODY_S, PROCESSES = "46c small tenants", 0.4, 3
ALONE, FLOOD, SMALL, SEED = 360, 360, 40, "bench-tenants"
#: The alone run's edges left out (s): the workers' first starts and the last bodies' tail.
EDGE_S = 2.0
USE_TARGET, LEAVE_TARGET = 0.95, 0.85
SHARED = f"concurrency={TENANTS_K}, share=True"
#: (per-key caps first: the shared scope's small tenants are judged against their waits)
VARIANTS = ((f"concurrency={TENANTS_PER_KEY} per key", "tenants_per_key"), (SHARED, "tenants_fair"),
            ("plain Celery", "share_plain"))
ACKS: tuple[tuple[str, dict[str, str]], ...] = (("acks_late=True", {"CT_ACKS_LATE": "1"}), ("acks on receipt", {}))


def smalls() -> list[dict[str, Any]]:
    """The small tenants' sends: tenant i sends 1 to 3 tasks, all at once."""
    draw = random.Random(SEED)
    names = [f"small{i}" for i in range(SMALL) for _ in range(draw.randint(1, 3))]
    return [{"args": [BODY_S], "vary": names, "vary_at": 0, "count": len(names), "ids": True}]


def alone_use(got: Run) -> float:
    """Body time / (K x the span from EDGE_S after the first start to EDGE_S before the last end)."""
    lo, hi = min(s.t0 for s in got.spans) + EDGE_S, max(s.t1 for s in got.spans) - EDGE_S
    return sum(max(0.0, min(s.t1, hi) - max(s.t0, lo)) for s in got.spans) / (TENANTS_K * (hi - lo))


def beside(got: Run) -> tuple[float, list[float]]:
    """The flood's use of what the small tenants leave, and their starts after send (sorted)."""
    lo = got.late[0]["times"][0]
    hi = max(s.t1 for s in got.spans if s.tenant != "flood")
    flood = sum(max(0.0, min(s.t1, hi) - max(s.t0, lo)) for s in got.spans if s.tenant == "flood")
    small = sum(max(0.0, min(s.t1, hi) - max(s.t0, lo)) for s in got.spans if s.tenant != "flood")
    waits = after_send(got.late, ((s.id, s.t0) for s in got.spans if s.tenant != "flood"))
    return flood / (TENANTS_K * (hi - lo) - small), waits


def run_tenants(res: Results, scale: Any) -> None:
    started, lines, small = time.time(), [], smalls()
    count = small[0]["count"]
    for acks, env in ACKS:
        capped: list[float] = []
        for name, task in VARIANTS:
            print(f"  tenants: {name}, {acks}: alone ({ALONE}) ...", flush=True)
            alone = run(task, [{"args": ["solo", BODY_S], "count": ALONE}], env=env, processes=PROCESSES,
                        k=TENANTS_K)
            used = alone_use(alone)
            print(f"  tenants: {name}, {acks}: {SMALL} small tenants ({count} tasks) beside {FLOOD} ...", flush=True)
            got = run(task, [{"args": ["flood", BODY_S], "count": FLOOD}], small, env=env, processes=PROCESSES,
                      k=TENANTS_K)
            leave, waits = beside(got)
            p50, p95 = percentile(waits, 0.5), percentile(waits, 0.95)
            ours, variant = task == "tenants_fair", f"{name}, {acks}"
            if task == "tenants_per_key":
                capped = [p50, p95]
            res.add(SEC, f"a tenant alone: the {TENANTS_K} slots used", variant, f"{used:.3f}", f">= {USE_TARGET:g}",
                    used >= USE_TARGET, f"{ALONE} bodies of {BODY_S:g} s, 2 workers x {PROCESSES}, Celery's default "
                    f"prefetch; from {EDGE_S:g} s after the first start to {EDGE_S:g} s before the last end", ours)
            res.add(SEC, "a flood beside small tenants: its use of what they leave", variant, f"{leave:.3f}",
                    f">= {LEAVE_TARGET:g}", leave >= LEAVE_TARGET,
                    f"{SMALL} tenants of 1 to 3 tasks ({count}) sent at once beside a flood of {FLOOD}", ours)
            res.add(SEC, "the small tenants' start after send, p50 / p95", variant,
                    f"{p50:.2f} / {p95:.2f} s ({len(waits)} of {count} ran)",
                    "<= per-key caps'" + (f" ({capped[0]:.2f} / {capped[1]:.2f} s)" if capped else ""),
                    bool(capped) and len(waits) == count and p50 <= capped[0] and p95 <= capped[1], "", ours)
            res.errors(f"tenants, {variant}", alone.errors + got.errors)
            lines.append(f"| {name} | {acks} | {used:.3f} | {leave:.3f} | {p50:.2f} / {p95:.2f} s |")
    res.table("tenants", (
        f"The fair share at Celery's defaults: 2 workers x {PROCESSES} prefork, default prefetch, bodies of "
        f"{BODY_S:g} s ({time.time() - started:.0f} s). Alone: {ALONE} tasks of one tenant, the {TENANTS_K} slots used "
        f"from {EDGE_S:g} s after the first start to {EDGE_S:g} s before the last end. Beside: {SMALL} tenants of 1 to 3 "
        f"tasks ({count}) sent at once once a flood of {FLOOD} runs; the flood's use of the slots they leave, their "
        "start after send.\n\n") + md(
        "| client | acks | alone: slots used | flood: use of what the small tenants leave | small tenants: start after "
        "send, p50 / p95 |", lines))
