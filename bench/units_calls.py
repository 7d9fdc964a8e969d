"""Far under the limit, one unit against two: script calls and store CPU per task.

    python -m bench.units_calls [N ...]      # default: 1000 10000

For each N, in turns: N tasks sent at once to 2 workers x 2 prefork processes, of
``bench.workerapp.sliding`` (``1000000/s``) and of ``sliding_tokens`` (the same rate and
``1000000000 tokens/s``, 5 tokens a call: a cost per rate, whose lease is of calls), the
throttle store a redis-server of its own (the broker is the bench's Redis), so its
``INFO commandstats`` and ``INFO cpu`` count this run alone. Sent by name from a client
without ``install``: the workers' checks alone (the consumer's screen and the pool's).
"""

from __future__ import annotations

import sys
import time

import redis

from bench.workers import WorkerGroup
from examples.local_redis import start

TASKS = ("sliding", "sliding_tokens")


def one(task: str, n: int) -> tuple[float, float, bool]:
    """(script calls per task, store CPU µs per task, every task ran)."""
    server = start()
    client = redis.Redis(port=server.port)
    group = WorkerGroup(f"ct-bench-units-{int(time.time())}", f"units-{task}", count=2, concurrency=2,
                        env={"CB_RATE": "1000000/s", "CB_THROTTLE_STORE": f"redis://127.0.0.1:{server.port}/0"})
    try:
        group.start()
        time.sleep(2)  # (the workers' first reads of the store, out of the count)
        client.config_resetstat()
        cpu0 = client.info("cpu")
        group.send(task, "u", group.queue, n)
        ran = group.wait_starts("u", n, timeout=n / 50 + 120)
        stats, cpu = client.info("commandstats"), client.info("cpu")
        calls = sum(stats.get(k, {}).get("calls", 0) for k in ("cmdstat_evalsha", "cmdstat_eval"))
        used = (cpu["used_cpu_user"] + cpu["used_cpu_sys"]) - (cpu0["used_cpu_user"] + cpu0["used_cpu_sys"])
        return calls / n, used / n * 1e6, ran
    finally:
        group.stop()
        client.close()
        server.stop()


def main(argv: list[str]) -> int:
    sizes = [int(a) for a in argv] or [1000, 10_000]
    print(f"{'task':15s} {'N':>7s}  script calls/task  store CPU/task  all ran")
    for n in sizes:
        for task in TASKS:
            calls, cpu, ran = one(task, n)
            print(f"{task:15s} {n:7d}  {calls:17.3f}  {cpu:11.0f} µs  {ran}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
