"""Sections run against real workers: bursts (1-3), overhead (6) and long waits (8)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

import celery_throttle
from bench.common import (
    BROKER_URL,
    STORE_URL,
    Results,
    fmt_bytes,
    fmt_num,
    ideal_makespan,
    max_in_aligned,
    max_in_window,
    store_client,
    used_memory,
)
from bench.workers import WorkerGroup
from celery_throttle.core.rates import parse_rate

#: (variant shown, task in bench.workerapp)
BURST_VARIANTS = (
    ("sliding", "sliding"),
    ("fixed", "fixed"),
    ("naive fixed (seed)", "naive_fixed"),
    ("naive sliding log", "naive_sliding"),
    ("celery rate_limit", "builtin"),
)
OURS = ("sliding", "fixed")


@dataclass
class BurstRun:
    """What one burst produced."""

    variant: str
    tasks: int
    limit: int
    window: float
    times: list[float] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    denied: int = 0
    complete: bool = False
    sent_at: float = 0.0
    #: CPU seconds all worker processes used for the run (denials and re-sends included).
    cpu: float = 0.0


def run_burst(group: WorkerGroup, variant: str, task: str, tasks: int, rate: str,
              phase: float = 0.6) -> BurstRun:
    """Send ``tasks`` calls at once, ``phase`` of the way into an aligned window, and
    wait for them all to start. Starting late in a window makes the fixed window's
    boundary burst show."""
    r = parse_rate(rate)
    label = f"burst-{task}"
    if r.period <= 5:  # align the burst with the window, within 5 s
        now = time.time()
        target = math.floor(now / r.period) * r.period + phase * r.period
        if target < now + 0.05:
            target += r.period
        time.sleep(max(target - time.time(), 0))
    run = BurstRun(variant, tasks, r.limit, r.period, sent_at=time.time())
    cpu0 = group.cpu()
    group.send(task, label, group.queue, tasks)
    timeout = ideal_makespan(tasks, r.limit, r.period) * 4 + 30
    if task == "builtin":  # Celery's rate_limit has a slow tail: take what starts in time
        timeout = ideal_makespan(tasks, r.limit, r.period) * 3 + 15
    run.complete = group.wait_starts(label, tasks, timeout, settle=1.5)
    run.cpu = group.cpu() - cpu0
    starts = group.starts(label)
    run.times = [t for t, _ in starts]
    run.ids = [i for _, i in starts]
    run.denied = group.counter("denied", label)
    return run


def report_bursts(res: Results, runs: list[BurstRun]) -> None:
    """Sections 1-3 from the burst runs."""
    for run in runs:
        n, m, w = run.limit, run.tasks, run.window
        ours = run.variant in OURS
        tag = f"{m} tasks at {n}/{w:g}s"
        if not run.times:
            res.add("1 violation", "max starts in any window / limit", run.variant, "no starts",
                    ok=False if ours else None)
            continue
        slide = max_in_window(run.times, w) / n
        aligned = max_in_aligned(run.times, w) / n
        if run.variant == "sliding":
            res.add("1 violation", "max in any window / limit", run.variant, f"{slide:.2f}", "<= 1.00",
                    slide <= 1.0, tag)
        elif run.variant == "fixed":
            res.add("1 violation", "max in an aligned window / limit", run.variant, f"{aligned:.2f}",
                    "<= 1.00", aligned <= 1.0, tag)
            res.add("1 violation", "max in any window / limit", run.variant, f"{slide:.2f}",
                    "<= 2.00 (nature)", slide <= 2.0, "across a boundary")
        else:
            note = f"aligned window max {aligned:.2f}" if "fixed" in run.variant else ""
            if run.variant == "celery rate_limit":
                note = "per worker node, 2 workers"
            res.add("1 violation", "max in any window / limit", run.variant, f"{slide:.2f}", "",
                    None, note)
    for run in runs:
        if not run.times:
            continue
        ideal = ideal_makespan(run.tasks, run.limit, run.window)
        span = max(run.times) - min(run.times)
        ratio = span / ideal if ideal else float("nan")
        ours = run.variant in OURS
        res.add("2 makespan", "first-to-last start / ideal", run.variant, f"{ratio:.3f}",
                "<= 1.05" if ours else "", (ratio <= 1.05) if ours else None,
                f"{span:.2f}s vs ideal {ideal:.2f}s")
    for run in runs:
        if run.variant == "celery rate_limit":
            res.add("3 re-sends", "re-sends per task", run.variant, "0 (held in worker)", "", None,
                    f"tasks wait in worker memory; worker CPU {run.cpu / run.tasks * 1000:.1f} ms/task")
            continue
        per_task = run.denied / run.tasks
        bound = (run.tasks - run.limit) / run.tasks + 0.05
        ours = run.variant in OURS
        res.add("3 re-sends", "re-sends per task", run.variant, f"{per_task:.2f}",
                f"<= {bound:.2f}" if ours else "", (per_task <= bound) if ours else None,
                f"{run.denied} denials; worker CPU {run.cpu / run.tasks * 1000:.1f} ms/task")
    for run in runs:
        unique = len(set(run.ids))
        dup = len(run.ids) - unique
        ok = run.complete and unique == run.tasks and dup == 0
        if run.variant == "celery rate_limit":
            waited = max(run.times, default=run.sent_at) - run.sent_at
            res.add("1 violation", "tasks started (in time)", run.variant,
                    f"{unique}/{run.tasks}, {dup} dup", "", None,
                    "" if ok else f"stopped waiting after {waited:.0f}s: Celery's rate_limit slows to a "
                    "few starts/s once the prefetched tasks are used (see chart)")
            continue
        res.add("1 violation", "each task ran exactly once", run.variant,
                f"{unique}/{run.tasks}, {dup} dup", "all, 0 dup", ok)


def run_overhead(group: WorkerGroup, tasks: int, rounds: int) -> dict[str, list[float]]:
    """Throughput (starts/s) of the same no-op, unthrottled and under a limit it never
    reaches, and the workers' CPU per task (key ``"<variant> cpu"``). The queue is
    filled first, then opened, so the sender does not pace it."""
    out: dict[str, list[float]] = {"unthrottled": [], "sliding": [], "fixed": [],
                                   "unthrottled cpu": [], "sliding cpu": [], "fixed cpu": []}
    order = (("unthrottled", "plain"), ("sliding", "fast_sliding"), ("fixed", "fast_fixed"))
    for r in range(rounds):
        for variant, task in (order if r % 2 == 0 else order[::-1]):
            label = f"ovh-{task}-{r}"
            queue = f"{group.prefix}-{label}"
            group.send(task, label, queue, tasks)
            cpu0 = group.cpu()
            if group.consume(queue) < group.count:
                raise RuntimeError(f"workers did not start consuming {queue}")
            group.wait_starts(label, tasks, tasks / 50 + 60, settle=0.3)
            out[f"{variant} cpu"].append((group.cpu() - cpu0) / tasks)
            group.consume(queue, on=False)
            times = sorted(t for t, _ in group.starts(label))
            if len(times) >= 2 and times[-1] > times[0]:
                out[variant].append((len(times) - 1) / (times[-1] - times[0]))
    return out


def report_overhead(res: Results, rates: dict[str, list[float]], tasks: int) -> None:
    """Each round runs the three variants back to back, so a round's ratios share its
    conditions; the median over rounds resists the shared machine's swings."""
    base = rates["unthrottled"]
    base_cpu = statistics.median(rates["unthrottled cpu"]) if rates["unthrottled cpu"] else float("nan")
    res.add("6 overhead", "no-op tasks/s (median round)", "unthrottled",
            fmt_num(statistics.median(base), 0) if base else "n/a", "", None,
            f"{tasks} tasks x {len(base)} rounds, 2 workers x 2 procs; worker CPU {base_cpu * 1000:.2f} ms/task")
    for variant in ("sliding", "fixed"):
        pairs = [(v, b) for v, b in zip(rates[variant], base) if b]
        ratio = statistics.median(v / b for v, b in pairs) if pairs else float("nan")
        cpu = statistics.median(rates[f"{variant} cpu"]) if rates[f"{variant} cpu"] else float("nan")
        res.add("6 overhead", "throttled / unthrottled tasks/s (median of rounds)", variant,
                f"{ratio:.2f}", ">= 0.90", ratio >= 0.90,
                f"worker CPU {cpu * 1000:.2f} ms/task: capacity ratio {base_cpu / cpu:.2f}")
    res.notes.append("Overhead rounds (tasks/s): " + "; ".join(
        f"{k}: {', '.join(fmt_num(x, 0) for x in v)}" for k, v in rates.items() if not k.endswith("cpu")))


def _controller(prefix: str) -> Any:
    app = Celery("bench-ctl", broker=BROKER_URL, set_as_current=False)
    app.conf.update(throttle_redis_url=STORE_URL, throttle_key_prefix=prefix)
    return celery_throttle.install(app)


def run_long_wait(res: Results, prefix: str, tasks: int, window: int, quick: bool) -> None:
    """Section 8: ``tasks`` calls against a spent quota of ``tasks`` per ``window`` s."""
    rate = f"{tasks}/{window}s"
    visibility = 10
    group = WorkerGroup(prefix, "long", env={
        "CB_LONG_RATE": rate, "CB_PARK_AFTER": "2", "CB_VISIBILITY": str(visibility)})
    redis_client = store_client()
    samples: list[tuple[float, int, int, int]] = []
    try:
        group.start()
        # Warm the pool processes up so the baseline is not their first-import growth.
        group.send("plain", "long-warmup", group.queue, 40)
        group.wait_starts("long-warmup", 40, 60, settle=1.0)
        by_pid0 = group.rss_by_pid()
        rss0, mem0, cpu0 = sum(by_pid0.values()), used_memory(redis_client), group.cpu()
        worst_pid = 0
        label = "long"
        queue = f"{prefix}-long-q"
        t_send = time.time()
        ids = group.send("long_wait", label, queue, tasks)
        send_s = time.time() - t_send
        ctl = _controller(prefix)
        spent = ctl.acquire("bench.workerapp.long_wait", key=label, rates=rate, cost=tasks)
        refill_at = spent.reset_at
        if group.consume(queue) < group.count:
            raise RuntimeError(f"workers did not start consuming {queue}")
        timeout = window + tasks / 40 + 120
        deadline = time.monotonic() + timeout
        denied_before = cpu_denials = 0.0
        while time.monotonic() < deadline:
            started = group.start_count(label)
            waiting, inflight, _ = ctl.parking.parked_count()
            samples.append((time.time(), group.rss(), used_memory(redis_client), waiting + inflight))
            if time.time() < refill_at:
                denied_before = group.counter("denied", label)
                cpu_denials = group.cpu() - cpu0
                by_pid = group.rss_by_pid()
                worst_pid = max([worst_pid] + [v - by_pid0.get(p, v) for p, v in by_pid.items()])
            if started >= tasks:
                break
            time.sleep(0.5)
        # Stay past the visibility timeout: a message held unacked would come back now.
        settle_until = time.time() + (visibility + 2 if not quick else 4)
        while time.time() < settle_until:
            samples.append((time.time(), group.rss(), used_memory(redis_client),
                            sum(ctl.parking.parked_count())))
            time.sleep(0.5)
        starts = group.starts(label)
        denied, parked = group.counter("denied", label), group.counter("parked", label)
        errors = group.errors()
    finally:
        group.stop()
    times = [t for t, _ in starts]
    seen = [i for _, i in starts]
    unique = len(set(seen))
    dup = len(seen) - unique
    foreign = len(set(seen) - set(ids))
    early = sum(1 for t in times if t < refill_at - 0.002)
    waiting = [s for s in samples if s[0] < refill_at]
    peak_rss = max((s[1] for s in waiting), default=rss0) - rss0
    peak_mem = max((s[2] for s in waiting), default=mem0) - mem0
    peak_parked = max((s[3] for s in samples), default=0)
    tag = f"{tasks} tasks, quota {rate} spent, park_after 2s, visibility_timeout {visibility}s"
    sec = "8 long waits"
    res.add(sec, "worker RSS growth while waiting", "sliding", f"{fmt_bytes(peak_rss)} "
            f"({peak_rss / tasks:.0f} B/task)", "", None,
            f"2 main + 4 pool processes, baseline {fmt_bytes(rss0)}; worst process +{fmt_bytes(worst_pid)}")
    res.add(sec, "Redis used_memory growth while waiting", "sliding",
            f"{fmt_bytes(peak_mem)} ({peak_mem / tasks:.0f} B/task)", "", None, "whole server")
    res.add(sec, "tasks parked in Redis (peak)", "sliding", f"{peak_parked}", "", None,
            f"{parked} parked of {denied} denials; {denied_before:.0f} denied before the refill")
    if denied_before:
        res.add(sec, "worker CPU per denial", "sliding", f"{cpu_denials / denied_before * 1000:.1f} ms",
                "", None, "all worker processes, while the quota was spent")
    res.add(sec, "ran exactly once", "sliding", f"{unique}/{tasks}, {dup} dup",
            "all, 0 dup", unique == tasks and dup == 0 and foreign == 0, tag)
    res.add(sec, "started before the quota refilled", "sliding", f"{early}", "0", early == 0)
    if times:
        res.add(sec, "all ran after refill within", "sliding", f"{max(times) - refill_at:.1f}s",
                "", None, f"send took {send_s:.1f}s")
    res.notes.append(
        "Long waits: parked messages live in Redis, so the workers' RSS growth is not held "
        "messages: it is what handling the denials leaves behind (garbage kept until a collection; "
        "RSS keeps the high-water mark).")
    if errors:
        res.notes.append(f"Long-wait worker log errors ({len(errors)}): " + " | ".join(errors[:5]))
    res.series["long_wait"] = {"samples": samples, "refill_at": refill_at, "rss0": rss0, "mem0": mem0}


def return_lateness(group: WorkerGroup, label: str) -> tuple[float, float, float, float] | None:
    """From the traced denials of ``label``: (how long the first round of denials took,
    then p50, p90 and max of how late each deferred task came back after its due time)."""
    raw = group.records.lrange(f"{group.prefix}:denials:{label}", 0, -1)
    if not raw:
        return None
    by_task: dict[str, list[tuple[float, float]]] = {}
    for item in raw:
        t, delay, task_id = item.decode().split()
        by_task.setdefault(task_id, []).append((float(t), float(delay)))
    started = {task_id: t for t, task_id in group.starts(label)}
    late: list[float] = []
    for task_id, denials in by_task.items():
        denials.sort()
        events = [t for t, _ in denials[1:]] + ([started[task_id]] if task_id in started else [])
        for (t, delay), back in zip(denials, events):
            late.append(back - (t + delay))
    if not late:
        return None
    late.sort()
    first = [d[0][0] for d in by_task.values()]
    origin = min(min(started.values(), default=min(first)), min(first))
    pick = lambda q: late[min(len(late) - 1, int(q * len(late)))]
    return max(first) - origin, pick(0.5), pick(0.9), late[-1]
