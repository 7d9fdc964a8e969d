"""Issue 44, item 5: the journal's price per waiting task on a Redis broker.

Each run: a redis-server for the broker (db 1), another for the store, a third for the notes (not
counted), 1 worker x 2. Each of 10 tenants' window (``50/5s``) spent, then a producer sends N tasks
over them: every task waits in its tenant's line, is released, and runs. Counted from before the
producer starts until every task ran: each server's commands and CPU (INFO) per task, and the
broker's RPOPs (only the keeper reads the journal with them; a worker consumes by BRPOP). Plain Celery
(the same task unthrottled) is the broker's baseline; the throttle runs with ``throttle_journal``
False and True.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import redis

from bench.common import Counts, Results, counts, md, new_prefix, produce, running, spend
from celery_throttle.celery_parts.journal_queue import journal_queue_name
from tests.harness import redis_server, waited

SEC, TENANTS, RATE, WINDOW_S = "journal", [f"t{i}" for i in range(10)], "50/5s", 5.0  # (bench/app.py's JOURNAL_RATE)
#: (name, task, CT_JOURNAL)
VARIANTS = (("plain Celery", "plain", ""), ("journal off", "journal_wait", "0"), ("journal on", "journal_wait", "1"))


def rpops(client: redis.Redis) -> int:
    return int((client.info("commandstats").get("cmdstat_rpop") or {}).get("calls", 0))


def one(task: str, journal: str, n: int) -> dict[str, Any]:
    """One run's counts: broker and store (:class:`Counts`), RPOPs, idle rates, seconds, what ran."""
    with ExitStack() as stack:
        broker, store, notes = (stack.enter_context(redis_server()) for _ in range(3))
        env = {"CT_JOURNAL": journal} if journal else {}
        group = stack.enter_context(running(new_prefix("journal"), store=store.url, records=notes.url, count=1,
                                            broker=f"redis://127.0.0.1:{broker.port}/1", env=env))
        b, s = (stack.enter_context(redis.Redis(port=x.port, db=1 if x is broker else 0)) for x in (broker, store))
        idle = counts(b), counts(s), time.time()
        time.sleep(3.0)  # (the worker's start-up traffic over; its idle traffic measured)
        idle = ((counts(b) - idle[0]).commands / (time.time() - idle[2]),
                (counts(s) - idle[1]).commands / (time.time() - idle[2]))
        if task != "plain":
            spend(store.url, group.prefix, f"bench.app.{task}", TENANTS, RATE)
        opens = time.time() + WINDOW_S  # (the windows open; a start before this did not wait)
        before, r0, t0 = (counts(b), counts(s)), rpops(b), time.time()
        produce(group, {"task": task, "count": n, "vary": TENANTS})
        done = waited(lambda: sum(group.started(t) for t in TENANTS) >= n, 120 + n / 20, 0.2)
        took = time.time() - t0
        time.sleep(0.5)  # (the last acks, the last gone events)
        got = (counts(b) - before[0], counts(s) - before[1])
        starts = [x["t"] for t in TENANTS for x in group.starts(t)]
        return {"broker": got[0], "store": got[1], "rpop": rpops(b) - r0, "idle": idle, "s": took, "done": done,
                "ran": len(starts), "early": sum(t < opens for t in starts) if task != "plain" else 0,
                "left": b.llen(journal_queue_name(group.prefix)), "errors": group.errors()}


def run_journal(res: Results, scale: Any) -> None:
    lines, ratios = [], []
    for n in scale.journal_sizes:
        got: dict[str, dict[str, Any]] = {}
        for name, task, journal in VARIANTS:
            print(f"  journal's price: {name}, {n:,} tasks ...", flush=True)
            r = got[name] = one(task, journal, n)
            b, s = r["broker"], r["store"]
            note = "; ".join(x for x in (
                "" if r["ran"] == n else f"{r['ran']:,} of {n:,} ran" + ("" if r["done"] else " (NOT all)"),
                f"{r['early']} did not wait" * bool(r["early"]),
                f"idle: broker {r['idle'][0]:.1f}, store {r['idle'][1]:.1f} commands/s") if x)
            lines.append(f"| {n:,} | {name} | {b.commands / n:.1f} | {s.commands / n:.1f} ({s.script_calls / n:.1f}) | {b.cpu_s / n * 1e6:.0f} | "
                         f"{s.cpu_s / n * 1e6:.0f} | {r['rpop'] / n:.2f} | {r['left']:,} | {r['s']:.1f} |")
            res.add(SEC, f"{n:,} waiting: broker, store commands/task; their CPU µs/task", name,
                    f"{b.commands / n:.1f}, {s.commands / n:.1f}; {b.cpu_s / n * 1e6:.0f}, {s.cpu_s / n * 1e6:.0f}",
                    ok=None, note=note)
            res.errors(f"journal {name} {n}", r["errors"])
        on, off, plain = (got[v[0]] for v in VARIANTS[::-1])

        def ratio(a: Counts, b: Counts) -> str:
            return f"{a.commands / b.commands:.2f} / {a.cpu_s / b.cpu_s:.2f}"
        ratios.append(f"| {n:,} | {ratio(on['broker'], off['broker'])} | {ratio(on['broker'], plain['broker'])} | "
                      f"{ratio(off['broker'], plain['broker'])} | {ratio(on['store'], off['store'])} | "
                      f"{(on['broker'].commands - off['broker'].commands) / n:.1f} |")
        res.series.setdefault(SEC, {})[n] = {k: {"broker": vars(v["broker"]), "store": vars(v["store"]),
                                                 "rpop": v["rpop"], "s": v["s"], "left": v["left"]}
                                             for k, v in got.items()}
    res.table(SEC, "The journal's price per waiting task, Redis broker and store on two redis-servers: 1 worker x 2 "
                   f"prefork, a producer process; 10 tenants at `{RATE}` each, their windows spent first, so every "
                   "task waits in a line, is released and runs (plain Celery: the same task, no throttle). Counted "
                   "until every task ran. Commands: INFO commandstats, a script's own commands and MULTI/EXEC's counted "
                   "in. Keeper RPOPs: journal messages the keeper read (or found absent); journal "
                   "left: messages in the journal queue at the end\n\n" + md(
                       "| Waiting tasks | Variant | Broker cmds/task | Store cmds/task (script calls) | Broker CPU µs/task | "
                       "Store CPU µs/task | Keeper RPOPs/task | Journal left | s |", lines)
                   + "\n\nRatios (commands / CPU)\n\n" + md(
                       "| Waiting tasks | broker: on / off | on / plain | off / plain | store: on / off | "
                       "broker cmds/task the journal adds |", ratios))
