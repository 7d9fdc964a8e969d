"""Section 12: what each task costs Redis, end to end, from a usual producer.

``python -m bench.redis_per_task [--quick | --sizes=N,N]``: this section alone, printed.

Each run has a redis-server of its own, the broker and the throttle's store (as for most
users), so its ``INFO commandstats`` and ``INFO cpu`` are the run's alone. One worker x 2
prefork processes of bench/app.py, started first; then a producer process (imports the app
module and sends with ``apply_async``, never finalizing it) sends N tasks over 10 tenants
(key ``{tenant}``), bodies that do nothing:

* under the limit (``1000000/s``): plain Celery; ours with the check at publish on (the
  default) and off; ``limits``' moving window called by hand in the task (the peer);
* a flood: each tenant's ``100/h`` spent first, so every task is turned away: ours keeps it
  in its key's line; the peer retries itself with a countdown (held in the worker).

From the producer's start until every task ran (or was turned away): script calls and their
µs, and the server's CPU per task, against plain Celery's. The bench polls the server every
0.2 s for the end, and the worker's releaser runs its chores: a few calls a second, not per task.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from bench.common import Counts, Results, counts, new_prefix, produce, spend, urls, workers
from celery_throttle.core.keys import line_index_key, window_keys
from tests.harness import redis_server

SEC, TENANTS, CALLS_TARGET, CPU_TARGET = "12 Redis per task", [f"t{i}" for i in range(10)], 0.5, 1.3
#: (name, task, CT_CHECK_AT_PUBLISH, flood); at the largest of several sizes, only BIG.
VARIANTS = (("plain Celery", "rpt_plain", "1", False), ("ours, check at publish on", "rpt_under", "1", False),
            ("ours, check at publish off", "rpt_under", "0", False),
            ("limits MovingWindow by hand", "rpt_peer_under", "1", False),
            ("ours, check at publish on", "rpt_flood", "1", True), ("ours, check at publish off", "rpt_flood", "0", True),
            ("limits MovingWindow by hand", "rpt_peer_flood", "1", True))
BIG = {("plain Celery", False), ("ours, check at publish on", False), ("ours, check at publish off", False),
       ("ours, check at publish on", True)}


def finished(client: Any, group: Any, task: str, flood: bool, n: int) -> bool:
    """Under the limit: the queue and the unacked hash empty; a flood: every task in its line
    (ours, found through the index of keys with a line) or held for its countdown (the peer)."""
    queued, unacked = client.llen(group.queue), client.hlen("unacked")
    if queued or not flood:
        return not queued and not unacked
    if task == "rpt_peer_flood":
        return bool(unacked >= n)
    keys = client.zrange(line_index_key(group.prefix), 0, -1)
    return not unacked and sum(client.zcard(window_keys(k.decode())[2]) for k in keys) >= n


def per_task(name: str, task: str, check: str, flood: bool, n: int) -> tuple[Counts, bool, float]:
    """(the server's counts, whether all ended, seconds) of one run."""
    with redis_server() as server:
        store = urls(server)[0]
        group = workers(new_prefix("rpt"), server, broker=store, count=1, env={"CT_CHECK_AT_PUBLISH": check})
        try:
            group.start()
            if flood and task == "rpt_peer_flood":
                from limits import parse, storage, strategies

                lim = strategies.MovingWindowRateLimiter(storage.RedisStorage(store, key_prefix=f"{group.prefix}-limits"))
                for t in TENANTS:
                    lim.hit(parse("100/hour"), t, cost=100)
            elif flood:
                spend(store, group.prefix, f"bench.app.{task}", TENANTS, "100/h")
            time.sleep(3.0)  # the worker's start-up traffic is over
            before, t0 = counts(group.records), time.time()
            produce(group, {"task": task, "count": n, "vary": TENANTS})
            deadline = time.monotonic() + 120 + n / 100
            while not (done := finished(group.records, group, task, flood, n)) and time.monotonic() < deadline:
                time.sleep(0.2)
            if done and not flood:
                time.sleep(0.5)  # the last prefetched tasks end
            return counts(group.records) - before, done, time.time() - t0
        finally:
            group.stop()


def run_rpt(res: Results, scale: Any, sizes: tuple[int, ...] = ()) -> None:
    sizes = sizes or scale.rpt_sizes
    plain: dict[int, float] = {}
    cells: dict[int, str] = {}
    lines = ["| Set | Variant | Tasks | Script calls/task | Script µs/task | Server CPU µs/task | CPU / plain | s |",
             "|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        for name, task, check, flood in VARIANTS:
            if n == max(sizes) and len(sizes) > 1 and (name, flood) not in BIG:
                continue
            which = "flood (100/h spent)" if flood else "under (1000000/s)"
            print(f"  Redis per task: {which}, {name}, {n:,} tasks ...", flush=True)
            got, done, took = per_task(name, task, check, flood, n)
            cpu = got.cpu_s / n * 1e6
            if task == "rpt_plain":
                plain[n] = cpu
            calls, ratio = got.script_calls / n, cpu / plain[n] if n in plain else math.nan
            lines.append(f"| {which} | {name} | {n:,} | {calls:.2f} | {got.script_us / n:.1f} | {cpu:.1f} | "
                         f"{ratio:.2f}x | {took:.1f}{'' if done else ' (NOT finished)'} |")
            on = check == "1" and task == "rpt_under"
            res.add(SEC, f"{which}, {n:,} tasks: script calls/task; Redis CPU/task vs plain", name,
                    f"{calls:.2f}; {cpu:.1f} µs ({ratio:.2f}x)", f"<= {CALLS_TARGET}; <= {CPU_TARGET}x" if on else "",
                    calls <= CALLS_TARGET and ratio <= CPU_TARGET and done if on else None,
                    "" if done else "NOT finished")
            if on:
                cells[n] = f"{n:,}: {calls:.2f}, {ratio:.2f}×".replace(",000", " 000")
    res.cell("rpt", "sliding", " / ".join(cells[n] for n in sorted(cells, reverse=True)))
    res.table("rpt", "Redis per task: a redis-server of its own per run (broker and store), 1 worker x 2 prefork "
                     "processes, a producer process (import + apply_async)\n\n" + "\n".join(lines))


if __name__ == "__main__":
    from bench.__main__ import FULL, QUICK, finish, section

    out, start = Results(), time.time()
    arg = next((a.removeprefix("--sizes=") for a in sys.argv[1:] if a.startswith("--sizes=")), "")
    section(out, "rpt", run_rpt, QUICK if "--quick" in sys.argv else FULL, tuple(int(x) for x in arg.split(",") if x))
    finish(out, " ".join(["python -m bench.redis_per_task", *sys.argv[1:]]), time.time() - start, "--quick" not in sys.argv)
