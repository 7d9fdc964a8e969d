"""Far under the limit, one unit against two: script calls and store CPU per task.

    python -m bench.units_calls [N ...]      # default: 1000 10000 (python -m bench --only units)

For each N, in turns: N tasks sent at once to 2 workers x 2 prefork processes, of bench/app.py's
``sliding`` (``1000000/s``) and ``sliding_tokens`` (the same rate and ``1000000000 tokens/s``, 5
tokens a call: a cost per rate, whose lease is of calls). The throttle's store is a
redis-server of its own (the broker and the notes another), so its counts are the run's
alone. Sent by name from a client without ``install``: the workers' checks alone.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import redis

from bench.common import Results, counts, new_prefix, urls, workers
from tests.harness import redis_server, waited


def one(task: str, n: int) -> tuple[float, float, bool]:
    """(script calls per task, store CPU µs per task, every task ran)."""
    with redis_server() as store, redis_server() as other:
        group = workers(new_prefix("units"), other, store=urls(store)[0], records=urls(other)[0],
                        env={"BENCH_RATE": "1000000/s"})
        try:
            group.start()
            time.sleep(2)  # (the workers' first reads of the store, out of the count)
            client = redis.Redis.from_url(urls(store)[0])
            before = counts(client)
            for _ in range(n):
                group.send(task, "u")
            ran = waited(lambda: group.started("u") >= n, n / 50 + 120)
            got = counts(client) - before
            client.close()
            return got.script_calls / n, got.cpu_s / n * 1e6, ran
        finally:
            group.stop()


def run_units(res: Results, scale: Any) -> None:
    lines = ["| task | N | script calls / task | store CPU / task | all ran |", "|---|---|---|---|---|"]
    for n in scale.units:
        for task in ("sliding", "sliding_tokens"):
            calls, cpu, ran = one(task, n)
            lines.append(f"| {'one unit' if task == 'sliding' else 'requests and tokens'} | {n:,} | {calls:.3f} "
                         f"| {cpu:.0f} µs | {'yes' if ran else 'NO'} |")
    res.table("units", "\n".join(lines))


if __name__ == "__main__":
    from bench.__main__ import FULL, finish, section

    out, started = Results(), time.time()
    section(out, "units", run_units, type(FULL)(**{**vars(FULL), "units": tuple(int(a) for a in sys.argv[1:]) or FULL.units}))
    finish(out, " ".join(["python -m bench.units_calls", *sys.argv[1:]]), time.time() - started, not sys.argv[1:])
