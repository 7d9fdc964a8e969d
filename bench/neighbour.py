"""Sections 10 (a noisy neighbour) and 14 (concurrency slots): a tenant's flood beside another.

10: A, its ``100/h`` spent, sends a flood of N on a queue the 2 workers x 2 open once it is
published; 3 s later B (same task, another key) sends 10, to start within 1 s whatever N. Variants:
ours, ours with the check at publish off, no throttle, the naive sliding log.
14: K=4 per tenant, 2 workers x 4, bodies of 0.2 s: a's flood then b's 20; then a slot held by a
SIGKILLed worker, freed after the lease. Plain Celery beside.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench.common import Results, after_send, counts, most_at_once, percentile, produce, served, spend

SEC, QUOTA, B_TASKS, B_AFTER, BIG = "10 noisy neighbour", "100/h", 10, 3.0, 100_000
#: name, task, how A's quota is spent, CT_CHECK_AT_PUBLISH, run beside a flood of BIG too
VARIANTS = (("celery_throttle", "neighbour", "ours", "1", True),
            ("celery_throttle, check at publish off", "neighbour", "ours", "0", False),
            ("no throttle", "plain", None, "1", True), ("naive sliding log", "neighbour_naive", "naive", "1", True))


def neighbour_run(name: str, task: str, spent: str | None, check: str, flood: int) -> dict[str, Any]:
    a, b = f"{task}-A", f"{task}-B"
    with served("nb", env={"CT_CHECK_AT_PUBLISH": check, "BENCH_DENIALS": "1"}) as (server, group):
        if spent == "ours":
            spend(server.url, group.prefix, f"bench.app.{task}", [a], QUOTA)
        elif spent == "naive":  # the sliding log full: a member per start, now
            log = f"{group.prefix}:naive-sliding:{a}"
            group.records.zadd(log, {f"spent-{i}": time.time() * 1000 for i in range(100)})
            group.records.expire(log, 3600)
        flood_q = f"{group.queue}-flood"
        sent = produce(group, {"task": task, "args": [a], "count": flood, "queue": flood_q, "pooled": True})[0]
        done = (lambda: group.started(a)) if spent is None else (lambda: group.note(f"denied:{a}"))
        at_publish = 0 if spent is None else done()
        if group.consume(flood_q) < group.count:
            raise RuntimeError("the workers did not open the flood's queue")
        time.sleep(max(sent["last"] + B_AFTER - 1.5 - time.time(), 0))  # (the producer takes ~1.5 s to start)
        b_sent = produce(group, {"task": task, "args": [b], "count": B_TASKS, "queue": flood_q, "ids": True})
        finished, deadline = sent["last"] if at_publish >= flood else None, time.time() + min(60 + flood * 0.004, 150)
        while time.time() < deadline and not (finished and group.started(b) >= B_TASKS):
            finished = finished or (time.time() if done() >= flood else None)
            time.sleep(0.1)
        return {"name": name, "flood": flood, "publish": sent["last"] - sent["first"], "done": done(),
                "latency": after_send(b_sent, ((s["id"], s["t"]) for s in group.starts(b))),
                "at_publish": at_publish, "errors": group.errors(),
                "flood_s": (finished - sent["last"]) if finished else None}


def run_neighbour(res: Results, scale: Any) -> None:
    runs = []
    for flood in scale.floods:
        for name, task, spent, check, big in VARIANTS:
            if flood < BIG or big:
                print(f"  noisy neighbour: {name}, flood of {flood:,} ...", flush=True)
                runs.append(neighbour_run(name, task, spent, check, flood))
    for run in runs:
        lat, n, ours = run["latency"], f"{run['flood']:,}", run["name"] == "celery_throttle"
        value = f"p50 {percentile(lat, 0.5):.2f}s, max {lat[-1]:.2f}s" if len(lat) == B_TASKS else \
            f"{len(lat)}/{B_TASKS} started"
        res.add(SEC, f"flood of {n}: B's start after its send", run["name"], value, "p50 <= 1s",
                len(lat) == B_TASKS and percentile(lat, 0.5) <= 1.0,
                f"B's {B_TASKS} sent {B_AFTER:g}s after A's flood was published (in {run['publish']:.1f}s)", ours)
        done = f"{run['flood_s']:.1f}s" if run["flood_s"] is not None else f"not by the end: {run['done']:,}"
        res.add(SEC, f"flood of {n}: all of A's tasks turned away (or ran)", run["name"], done, "", None,
                f"after the flood was published; turned away at publish: {run['at_publish']:,}")
        res.errors(f"noisy neighbour, {run['name']}, {n}", run["errors"])
    for column, name in (("sliding", "celery_throttle"), ("naive sliding log", "naive sliding log")):
        got = [r["latency"] for r in runs if r["name"] == name]
        res.cell("neighbour", column, " / ".join(f"{percentile(lat, 0.5):.2f} s" if len(lat) == B_TASKS else
                                                 f"{len(lat)} of {B_TASKS}" for lat in got))


SLOTS, K, BODY_S, OTHERS, PROCESSES, LEASE_S = "14 concurrency", 4, 0.2, 20, 8, 3.0


def slots_run(res: Results, flood: int, task: str) -> tuple[float, float]:
    with served(task, one_db=True, concurrency=PROCESSES // 2, env={"CT_PREFETCH": "1"}) as (_, group):
        before = counts(group.records)
        a, b = produce(group, {"task": task, "args": ["a", BODY_S], "count": flood},
                       {"task": task, "args": ["b", BODY_S], "count": OTHERS, "ids": True})
        total = flood + OTHERS
        group.await_noted("spans", total, flood * BODY_S / K * 3 + 60, 0.2)
        delta = counts(group.records) - before
        spans = [(float(t0), float(t1), who) for t0, t1, who in group.noted("spans")]
    ours, limit = task == "export", K if task == "export" else PROCESSES
    variant = f"{'K=4' if ours else 'plain Celery'}, N={flood:,}"
    latency = sorted(t - s for t, s in zip(sorted(t0 for t0, _, who in spans if who == "b"), b["times"]))
    makespan = max(t1 for _, t1, who in spans if who == "a") - a["first"]
    whole = max(t1 for _, t1, _ in spans) - a["first"]
    if ours:
        most = [most_at_once(s for s in spans if s[2] == t) for t in "ab"]
        res.add(SLOTS, "most of one tenant running at once", f"N={flood:,}", f"a {most[0]}, b {most[1]}", f"<= {K}",
                max(most) <= K)
    p50 = percentile(latency, 0.5)
    res.add(SLOTS, "b's start latency p50 / max", variant, f"{p50:.2f} s / {latency[-1]:.2f} s",
            "p50 <= 1 s", p50 <= 1.0, "" if ours else "behind a's flood", ours)
    res.add(SLOTS, "a's makespan / ideal", variant,
            f"{makespan:.1f} s / {flood * BODY_S / limit:.1f} s = {makespan / (flood * BODY_S / limit):.2f}")
    res.add(SLOTS, "utilisation / ideal for this load", variant,
            f"{sum(t1 - t0 for t0, t1, _ in spans) / (min(PROCESSES, limit) * whole):.2f}")
    res.add(SLOTS, "Redis commands per task (all / script calls); CPU per task", variant,
            f"{delta.commands / total:.1f} / {delta.script_calls / total:.1f}; {delta.cpu_s / total * 1e6:.0f} µs",
            note="all: the broker's, and those each script runs (INFO commandstats counts both)")
    return p50, latency[-1]


def run_slots(res: Results, scale: Any) -> None:
    for flood in scale.slot_floods:
        got = {}
        for task in ("export", "slots_plain"):
            print(f"  concurrency: flood of {flood:,} ({task}) ...", flush=True)
            got[task] = slots_run(res, flood, task)
        if flood == max(scale.slot_floods):
            res.cell("slots", "sliding", f"{got['export'][0]:.2f} s (N = {flood:,})")
            res.cell("slots", "Celery `rate_limit`", f"plain Celery: {got['slots_plain'][0]:.1f} s")
    print("  concurrency: SIGKILL reclaim ...", flush=True)
    env = {"CT_SLOT_LEASE": str(LEASE_S), "CT_PREFETCH": "1"}
    with served("kill", one_db=True, concurrency=1, env=env) as (_, group):
        produce(group, {"task": "export_one", "args": ["k", 60]})
        group.await_noted("began", 1, 30)
        holder = int(group.noted("began")[0][2])
        produce(group, {"task": "export_one", "args": ["k", 0]})
        time.sleep(1.0)
        os.killpg(next(p for p in group.procs if p is not None and p.pid == holder).pid, 9)
        killed = time.time()
        group.await_noted("began", 2, 60, 0.05)
        took = float(group.noted("began")[1][0]) - killed
    res.add(SLOTS, "slot of a SIGKILLed worker reclaimed after", f"lease {LEASE_S:.0f} s", f"{took:.1f} s",
            "<= lease + 5 s sweep", took <= LEASE_S + 6)
