"""Far under the limit, one unit against two: script calls and store CPU per task.

``python -m bench.units_calls [N ...]`` (default 1000 10000; also ``python -m bench --only units``): N
tasks sent by name to ``sliding`` and ``sliding_tokens`` (5 tokens a call: a lease of calls), the store
a redis-server of its own.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import redis

from bench.common import Results, counts, md, served, standalone, yes
from tests.harness import waited


def one(task: str, n: int) -> tuple[float, float, bool]:
    """(script calls per task, store CPU µs per task, every task ran)."""
    with served("units", apart=True, env={"BENCH_RATE": "1000000/s"}) as (store, group):
        time.sleep(2)  # (the workers' first reads of the store, out of the count)
        client = redis.Redis.from_url(store.url)
        before = counts(client)
        for _ in range(n):
            group.send(task, "u")
        ran = waited(lambda: group.started("u") >= n, n / 50 + 120)
        got = counts(client) - before
        client.close()
        return got.script_calls / n, got.cpu_s / n * 1e6, ran


def run_units(res: Results, scale: Any) -> None:
    rows = []
    for n in scale.units:
        for task, name in (("sliding", "one unit"), ("sliding_tokens", "requests and tokens")):
            calls, cpu, ran = one(task, n)
            rows.append(f"| {name} | {n:,} | {calls:.3f} | {cpu:.0f} µs | {yes(ran)} |")
    res.table("units", md("| task | N | script calls / task | store CPU / task | all ran |", rows))


if __name__ == "__main__":
    from bench.__main__ import FULL

    sizes = tuple(int(a) for a in sys.argv[1:])
    standalone("bench.units_calls", None, type(FULL)(**{**vars(FULL), "units": sizes or FULL.units}), not sizes,
               ("units", run_units))
