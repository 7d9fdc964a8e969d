"""Far under the limit, one unit against two: script calls and store CPU per task.

    python -m bench.units_calls [N ...]      # default: 1000 10000 (python -m bench --only units)

For each N, in turns: N tasks sent at once by name (no ``install``: the workers' checks alone) to
2 workers x 2 prefork of bench/app.py's ``sliding`` (``1000000/s``) and ``sliding_tokens`` (the
same and ``1000000000 tokens/s``, 5 tokens a call: a lease of calls), the store a redis-server of
its own (broker and notes on another), so that its counts are the run's alone.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import redis

from bench.common import Results, counts, md, new_prefix, running, standalone, urls, yes
from tests.harness import redis_server, waited


def one(task: str, n: int) -> tuple[float, float, bool]:
    """(script calls per task, store CPU µs per task, every task ran)."""
    with (redis_server() as store, redis_server() as other,
          running(new_prefix("units"), other, store=urls(store)[0], records=urls(other)[0],
                  env={"BENCH_RATE": "1000000/s"}) as group):
        time.sleep(2)  # (the workers' first reads of the store, out of the count)
        client = redis.Redis.from_url(urls(store)[0])
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
    standalone(" ".join(["python -m bench.units_calls", *sys.argv[1:]]),
               type(FULL)(**{**vars(FULL), "units": sizes or FULL.units}), not sizes, ("units", run_units))
