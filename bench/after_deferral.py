"""``python -m bench.after_deferral [--only rows|depth|controls|journal] [--runs N]``: capacity
that appears after tasks were deferred, and what a deep line, a large control hash and the
journal cost.

rows: each row of the scheduler issue's table, on real workers fed by a producer process
that imports the task module and sends (the test harness of tests/test_after_deferral.py,
whose tasks live in tests/taskapp.py), against what the new capacity allows:

- raise: 60 tasks of a tenant at ``6/m``; once 6 ran, the key is raised to ``600/m``. The
  54 others fit the sliding window at once: the ideal is the time 4 processes take to
  start them (measured: ~0), so the figure is seconds from the raise to the last start.
- reset: 30 at ``6/m``; once 6 ran, the key is reset and raised to ``300/m``: as above.
- refunds: 30 calls at ``10/4s``, each estimated at 5 units and reporting 1 (``charge``).
  A call starts while its estimate fits beside what was reported: 6 a window, so the ideal
  last start is at 4 windows (16 s) after the first.
- slow pool: 40 bodies of 1 s on 2 processes at ``10/2s``: the pool sets the pace, so
  the ideal makespan is 20 s.

depth: a key of ``20/s`` with D tasks in its line (D = 100 … 100 000), on a store of its
own; its line released and each task claimed as it comes, on a test clock: the script
time per task released and claimed (µs, from Redis' own commandstats), and the memory
per waiting task. A deep line should cost the same per task as a short one.

controls: a control hash of P pauses in force (P = 100 … 50 000, a Backoff per tenant), on
a store of its own: the time of one process's refresh when it reads the hash whole (as
each did every 0.5 s before the stamp) and by the stamp, and the script time of one pause
(Redis' commandstats) with pause.lua before the stamp (it read the whole hash to prune)
and now.

journal: with RabbitMQ as broker, a producer sends D tasks (D = 1 000 … 100 000) of a spent
key (``1/h``), which wait in its line, on a store of its own; with the journal off, then
on (side by side, one key each): the producer's seconds per task sent, and then the
keeper's: a pass over the journal (each task's copy read and published again) and, once
the store is emptied, the two passes that send every task on (seconds per task). What the
journal costs should not grow with the depth of the lines.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from typing import Any

import redis

ROWS = ("raise", "reset", "refunds", "slow pool")
DEPTHS = (100, 1_000, 10_000, 100_000)


def _rows(runs: int) -> list[tuple[str, list[float], float, str]]:
    import celery_throttle
    from tests.helpers import BROKER_URL, STORE_URL, WorkerGroup, new_label
    from tests.taskapp import app as tasks_app

    out: list[tuple[str, list[float], float, str]] = []
    store = redis.Redis.from_url(STORE_URL)

    def group(**kw: Any) -> WorkerGroup:
        return WorkerGroup(prefix=f"ct-bench-{uuid.uuid4().hex[:10]}", broker=BROKER_URL, store=STORE_URL, **kw)

    def cleanup(g: WorkerGroup) -> None:
        g.stop()
        for key in store.scan_iter(match=f"{g.prefix}*", count=1000):
            store.delete(key)

    four = group(count=2, concurrency=2).start()
    try:
        ctl = celery_throttle.Throttle(tasks_app, {"redis_url": STORE_URL, "key_prefix": four.prefix})
        figures: dict[str, list[float]] = {"raise": [], "reset": [], "refunds": []}
        for _ in range(runs):
            label, tenant = new_label(), f"r-{new_label()}"
            four.produce({"how": "delay", "task": "raisable", "args": [label, tenant], "count": 60})
            four.wait_starts(label, 6, timeout=30, settle=1.0)
            at = time.time()
            ctl.set_limit("raisable", ["600/m"], key=tenant)
            figures["raise"].append(max(e["t"] for e in four.wait_starts(label, 60, timeout=60)) - at)

            label, tenant = new_label(), f"s-{new_label()}"
            four.produce({"how": "delay", "task": "raisable", "args": [label, tenant], "count": 30})
            four.wait_starts(label, 6, timeout=30, settle=1.0)
            at = time.time()
            ctl.reset("raisable", key=tenant)
            ctl.set_limit("raisable", ["300/m"], key=tenant)
            figures["reset"].append(max(e["t"] for e in four.wait_starts(label, 30, timeout=60)) - at)

            label, tenant = new_label(), f"f-{new_label()}"
            four.produce({"how": "delay", "task": "refunded", "args": [label, tenant], "count": 30})
            times = sorted(e["t"] for e in four.wait_starts(label, 30, timeout=90))
            figures["refunds"].append(times[-1] - times[0])
        ctl.close()
        out.append(("raise 6/m to 600/m, 54 waiting: s from the raise to the last start", figures["raise"], 0.0,
                    "before: 0 of 54 in 25 s"))
        out.append(("reset and raise to 300/m, 24 waiting: s to the last start", figures["reset"], 0.0,
                    "before: 5 of 30 within 25 s"))
        out.append(("30 calls at 10/4s, estimate 5, charge(1): first to last start, s", figures["refunds"], 16.0,
                    "before: 57.9 s"))
    finally:
        cleanup(four)
    slow_figures = []
    for _ in range(runs):
        two = group(count=1, concurrency=2, env={"CT_PREFETCH": "1"}).start()
        try:
            label, tenant = new_label(), f"p-{new_label()}"
            two.produce({"how": "delay", "task": "slow_body", "args": [label, tenant], "count": 40})
            times = sorted(e["t"] for e in two.wait_starts(label, 40, timeout=90))
            slow_figures.append(times[-1] + 1.0 - times[0])
        finally:
            cleanup(two)
    out.append(("40 bodies of 1 s, 2 processes, 10/2s: makespan, s", slow_figures, 20.0, "before: 36.9 s"))
    store.close()
    return out


def _depth(depths: tuple[int, ...]) -> list[tuple[int, float, float]]:
    """(depth, script µs per task released and claimed, bytes per waiting task): section
    9's measure (bench/backlog.py), on a redis-server of its own."""
    from bench.backlog import dedicated_redis, measure_line

    with dedicated_redis("depth") as red:
        runs = [(d, measure_line(red.url, red.client, "depth", "sliding", d)) for d in depths]
    return [(d, r["us_per_task"], r["bytes_per_waiting"]) for d, r in runs]


#: Pauses in the control hash the controls rows are measured at (a Backoff per tenant).
PAUSES = (100, 5_000, 50_000)
#: pause.lua before the stamp (git show 903274a:celery_throttle/lua/pause.lua, since moved to celery_throttle/store/lua): it pruned by
#: reading the whole hash, and every process read the hash whole every refresh.
BEFORE = "903274a"


def _controls(sizes: tuple[int, ...], reads: int = 20) -> list[tuple[int, float, float, float, float]]:
    """(pauses, ms per refresh read whole, ms per refresh by the stamp, script µs per pause
    before, now): on a redis-server of its own, the hash filled with per-key pauses in
    force, each figure the mean of ``reads`` calls, side by side."""
    import subprocess

    from bench.backlog import dedicated_redis
    from celery_throttle.check.controls import Controls, pause_field
    from celery_throttle.core.state import FOREVER_US
    from celery_throttle.store.client import RedisStore

    old_lua = subprocess.run(["git", "show", f"{BEFORE}:celery_throttle/lua/pause.lua"], capture_output=True,
                             text=True, check=True).stdout
    out = []
    with dedicated_redis("controls") as red:
        store = RedisStore(red.url, "bench")
        old = red.client.register_script(old_lua)
        for size in sizes:
            red.client.delete("bench:control")
            for start in range(0, size, 1000):
                red.client.hset("bench:control", mapping={
                    pause_field("api", f"tenant-{i}"): str(FOREVER_US) for i in range(start, min(size, start + 1000))})
            store.pause(pause_field("api", "stamped"), 600)
            whole = stamped = 0.0
            controls = Controls()
            controls.refresh(store)
            for _ in range(reads):
                t = time.perf_counter()
                store.controls()
                whole += time.perf_counter() - t
                t = time.perf_counter()
                controls.refresh(store)
                stamped += time.perf_counter() - t
            red.client.config_resetstat()
            for i in range(reads):
                old(keys=["bench:control"], args=["", pause_field("api", f"old-{i}"), 60_000_000, FOREVER_US])
            before_us = red.client.info("commandstats")["cmdstat_evalsha"]["usec"] / reads
            red.client.config_resetstat()
            for i in range(reads):
                store.pause(pause_field("api", f"new-{i}"), 60)
            now_us = red.client.info("commandstats")["cmdstat_evalsha"]["usec"] / reads
            out.append((size, whole / reads * 1e3, stamped / reads * 1e3, before_us, now_us))
        store.close()
    return out


#: Tasks waiting in a line the journal rows are measured at.
JOURNALED = (1_000, 10_000, 100_000)


def _journal(sizes: tuple[int, ...]) -> list[tuple[int, float, float, float, float]]:
    """(tasks, µs per send with the journal off, on, µs per task of a pass, of the
    recovery's two passes): a producer and a keeper in this process, RabbitMQ as broker,
    a redis-server of its own as store."""
    from celery import Celery
    from kombu.connection import Connection
    from kombu.entity import Queue

    from bench.backlog import dedicated_redis
    from celery_throttle import throttle
    from celery_throttle.check.limiter import Throttle
    from celery_throttle.core import journal
    from celery_throttle.integration.publish import wrap_send_task
    from celery_throttle.waits.keeper import Keeper
    from tests.conftest import RABBITMQ_URL
    from tests.helpers import delete_queues

    journal.LOST_AFTER_US = 0  # (the two passes of a recovery back to back: the keeper's cost alone)
    out = []
    with dedicated_redis("journal") as red:
        for size in sizes:
            per_send, queues = {}, []
            for on in (False, True):
                prefix = f"ct-bench-{uuid.uuid4().hex[:8]}"
                app = Celery("journal-bench", broker=RABBITMQ_URL, set_as_current=False)
                app.conf.task_default_queue = f"{prefix}-q"

                @app.task(name="bench.journaled", shared=False)
                @throttle("1/h")
                def work(n: int) -> None: ...

                ctl = Throttle(app, {"redis_url": red.url, "key_prefix": prefix, "journal": on})
                wrap_send_task(ctl)
                queues += [f"{prefix}-q", ctl.lines.journal.broker.name]
                t = time.perf_counter()
                for n in range(size):
                    work.delay(n)
                per_send[on] = (time.perf_counter() - t) / size * 1e6
            keeper = Keeper(ctl)
            keeper.pass_now()  # (the first adopts what it holds too: not timed)
            t = time.perf_counter()
            keeper.pass_now()
            one_pass = (time.perf_counter() - t) / size * 1e6
            red.client.flushall()
            t = time.perf_counter()
            keeper.pass_now()
            keeper.pass_now()
            recovery = (time.perf_counter() - t) / size * 1e6
            with Connection(RABBITMQ_URL) as conn:
                sent_on = Queue(f"{prefix}-q")(conn.default_channel).queue_declare(passive=True).message_count
            assert sent_on >= size - 1, (sent_on, size)
            keeper._close()
            ctl.close()
            delete_queues(RABBITMQ_URL, queues)
            red.client.flushall()
            out.append((size, per_send[False], per_send[True], one_pass, recovery))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.after_deferral", description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("rows", "depth", "controls", "journal"), action="append", default=[])
    p.add_argument("--runs", type=int, default=3, help="runs of each row (default 3)")
    args = p.parse_args(argv)
    only = set(args.only) or {"rows", "depth", "controls", "journal"}
    os.environ.setdefault("CT_QUICK", "0")
    if "rows" in only:
        print(f"| capacity after the deferral ({args.runs} runs) | runs | ideal | worst / ideal | before |")
        print("|---|---|---|---|---|")
        for name, figures, ideal, before in _rows(args.runs):
            shown = ", ".join(f"{f:.2f}" for f in figures)
            ratio = f"{max(figures) / ideal:.3f}" if ideal else f"{max(figures):.2f} s over"
            print(f"| {name} | {shown} | {ideal:.1f} | {ratio} | {before} |")
    if "depth" in only:
        print("\n| tasks in the line | script µs per task released and claimed | bytes per waiting task |")
        print("|---|---|---|")
        for depth, us, per_task in _depth(DEPTHS):
            print(f"| {depth:,} | {us:.0f} | {per_task:.0f} |")
    if "controls" in only:
        print("\n| pauses in force | refresh, hash read whole (ms) | refresh by the stamp (ms) "
              f"| a pause's script, before {BEFORE} (µs) | now (µs) |")
        print("|---|---|---|---|---|")
        for size, whole, stamped, before, now in _controls(PAUSES):
            print(f"| {size:,} | {whole:.2f} | {stamped:.3f} | {before:.0f} | {now:.0f} |")
    if "journal" in only:
        print("\n| tasks waiting | producer µs per task, journal off | on | on / off | keeper's pass, µs per task "
              "| recovery's two passes, µs per task |")
        print("|---|---|---|---|---|---|")
        for size, off, on, one_pass, recovery in _journal(JOURNALED):
            print(f"| {size:,} | {off:.0f} | {on:.0f} | {on / off:.2f} | {one_pass:.0f} | {recovery:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
