"""Section 12: what each task costs Redis, end to end, from a usual producer.

``python -m bench.redis_per_task [--quick | --sizes=N,N]``: this section alone. Each run: a redis-server
of its own, 1 worker x 2, a producer sending N empty tasks over 10 tenants, under the limit or a flood
(each ``100/h`` spent): script calls, their µs, the server's CPU per task against plain Celery's.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from bench.common import Counts, Results, counts, md, produce, served, spend, standalone
from celery_throttle.core.keys import line_index_key, window_keys

SEC, TENANTS, CALLS_TARGET, CPU_TARGET = "12 Redis per task", [f"t{i}" for i in range(10)], 0.5, 1.3
ON, OFF, PEER = "ours, check at publish on", "ours, check at publish off", "limits MovingWindow by hand"
RECORDED = "ours, check at publish on, throttle_record on"
SHADOW = "ours, throttle_mode = \"shadow\""
#: (name, task, CT_CHECK_AT_PUBLISH, flood, run at the largest of several sizes too, more env)
VARIANTS: tuple[tuple[str, str, str, bool, bool, dict[str, str]], ...] = (
    ("plain Celery", "rpt_plain", "1", False, True, {}), (ON, "rpt_under", "1", False, True, {}),
    (RECORDED, "rpt_under", "1", False, True, {"CT_RECORD": "100000"}),
    (SHADOW, "rpt_under", "1", False, True, {"CT_MODE": "shadow"}),
    (OFF, "rpt_under", "0", False, True, {}), (PEER, "rpt_peer_under", "1", False, False, {}),
    (ON, "rpt_flood", "1", True, True, {}), (OFF, "rpt_flood", "0", True, False, {}),
    (PEER, "rpt_peer_flood", "1", True, False, {}))


def finished(client: Any, group: Any, task: str, flood: bool, n: int) -> bool:
    """Under the limit: queue and unacked hash empty; a flood: every task in its line (ours,
    found through the index of keys with a line) or held for its countdown (the peer)."""
    queued, unacked = client.llen(group.queue), client.hlen("unacked")
    if queued or not flood:
        return not queued and not unacked
    if task == "rpt_peer_flood":
        return bool(unacked >= n)
    keys = client.zrange(line_index_key(group.prefix), 0, -1)
    return not unacked and sum(client.zcard(window_keys(k.decode())[2]) for k in keys) >= n


def per_task(task: str, check: str, flood: bool, n: int, env: dict[str, str] | None = None) -> tuple[Counts, bool, float]:
    """(the server's counts, whether all ended, seconds) of one run."""
    with served("rpt", one_db=True, count=1, env={"CT_CHECK_AT_PUBLISH": check, **(env or {})}) as (server, group):
        store = server.url
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
        deadline = time.monotonic() + 120 + n / 100  # (polled every 0.2 s: a few calls a second, not per task)
        while not (done := finished(group.records, group, task, flood, n)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if done and not flood:
            time.sleep(0.5)  # the last prefetched tasks end
        return counts(group.records) - before, done, time.time() - t0


def run_rpt(res: Results, scale: Any, sizes: tuple[int, ...] = ()) -> None:
    sizes = sizes or scale.rpt_sizes
    plain: dict[int, float] = {}
    cells: dict[int, str] = {}
    lines = []
    for n in sizes:
        for name, task, check, flood, big, env in VARIANTS:
            if n == max(sizes) and len(sizes) > 1 and not big:
                continue
            which = "flood (100/h spent)" if flood else "under (1000000/s)"
            print(f"  Redis per task: {which}, {name}, {n:,} tasks ...", flush=True)
            got, done, took = per_task(task, check, flood, n, env)
            cpu = got.cpu_s / n * 1e6
            if task == "rpt_plain":
                plain[n] = cpu
            calls, ratio = got.script_calls / n, cpu / plain[n] if n in plain else math.nan
            lines.append(f"| {which} | {name} | {n:,} | {calls:.2f} | {got.script_us / n:.1f} | {cpu:.1f} | "
                         f"{ratio:.2f}x | {took:.1f}{'' if done else ' (NOT finished)'} |")
            on = name == ON and task == "rpt_under"
            res.add(SEC, f"{which}, {n:,} tasks: script calls/task; Redis CPU/task vs plain", name,
                    f"{calls:.2f}; {cpu:.1f} µs ({ratio:.2f}x)", f"<= {CALLS_TARGET}; <= {CPU_TARGET}x" if on else "",
                    calls <= CALLS_TARGET and ratio <= CPU_TARGET and done if on else None,
                    "" if done else "NOT finished")
            if on:
                cells[n] = f"{n:,}: {calls:.2f}, {ratio:.2f}×".replace(",000", " 000")
    res.cell("rpt", "sliding", " / ".join(cells[n] for n in sorted(cells, reverse=True)))
    res.table("rpt", "Redis per task: a redis-server of its own per run (broker and store), 1 worker x 2 prefork "
                     "processes, a producer process (import + apply_async)\n\n" + md(
                         "| Set | Variant | Tasks | Script calls/task | Script µs/task | Server CPU µs/task | CPU / plain | s |",
                         lines))


if __name__ == "__main__":
    from bench.__main__ import FULL, QUICK

    if any(a != "--quick" and not a.startswith("--sizes=") for a in sys.argv[1:]):
        sys.exit(f"usage: python -m bench.redis_per_task [--quick | --sizes=N,N]\n{__doc__}")
    arg = next((a.removeprefix("--sizes=") for a in sys.argv[1:] if a.startswith("--sizes=")), "")
    standalone("bench.redis_per_task", None, QUICK if "--quick" in sys.argv else FULL, "--quick" not in sys.argv,
               ("rpt", run_rpt, tuple(int(x) for x in arg.split(",") if x)))
