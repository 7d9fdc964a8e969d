"""Sections 1-4 (a burst: violation, makespan, re-sends, the baselines; the chart), 10 (a noisy
neighbour) and 13 (a slow store).

1-4: ``burst_tasks`` calls of one key sent at once, 60 % into an aligned window (the fixed window's
boundary burst shows), to 2 workers x 2 prefork: ours sliding and fixed, the naive baselines, Celery's
``rate_limit``. 13: 30 tasks at ``10/s`` on 1 worker x 4, the store behind tests/slow_proxy.py (0 or
100 ms late), side by side each round: the pace at 100 ms over the pace at 0 ms (target >= 0.8).
10: A, its ``100/h`` spent, sends a flood of N on a queue the 2 workers x 2 open once it is published;
3 s later B (same task, another key) sends 10, to start within 1 s whatever N. Variants: ours, ours
with the check at publish off, no throttle, the naive sliding log. (Concurrency slots beside a flood:
section 17, bench/share.py.)
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from typing import Any

from bench.common import OUT, Results, after_send, new_prefix, percentile, produce, running, served, spend
from celery_throttle.core.rates import parse_rate
from tests.harness import redis_server, waited
from tests.helpers import SlowProxy, max_in_aligned_windows, max_in_window

#: (variant shown, its task in bench/app.py, its column of the headline table)
VARIANTS = (("sliding", "sliding", "sliding"), ("fixed", "fixed", "fixed"),
            ("naive fixed (seed)", "naive_fixed", "naive fixed (seed)"),
            ("naive sliding log", "naive_sliding", "naive sliding log"),
            ("celery rate_limit", "builtin", "Celery `rate_limit`"))
OURS = ("sliding", "fixed")


def burst(group: Any, task: str, tasks: int, rate: str, phase: float = 0.6) -> dict[str, Any]:
    """Send ``tasks`` calls at once ``phase`` into an aligned window; wait for them to start
    (Celery's rate_limit has a slow tail: what starts in time)."""
    r, label = parse_rate(rate), f"burst-{task}"
    target = math.floor(time.time() / r.period) * r.period + phase * r.period
    time.sleep(max(target + (r.period if target < time.time() + 0.05 else 0) - time.time(), 0))
    for _ in range(tasks):
        group.send(task, label)
    ideal = (math.ceil(tasks / r.limit) - 1) * r.period
    complete = waited(lambda: group.started(label) >= tasks, ideal * (3 if task == "builtin" else 4) + 20)
    time.sleep(1.5)  # a task run twice would show now
    starts = group.starts(label)
    return {"times": [s["t"] for s in starts], "ids": [s["id"] for s in starts], "denied": group.note(f"denied:{label}"),
            "complete": complete, "tasks": tasks, "limit": r.limit, "window": r.period, "ideal": ideal}


def run_burst(res: Results, scale: Any) -> None:
    runs = {}
    with served("burst", env={"BENCH_RATE": scale.rate, "BENCH_DENIALS": "1"}) as (_, group):
        for variant, task, _ in VARIANTS:
            print(f"  burst: {variant}, {scale.burst_tasks} tasks at {scale.rate} ...", flush=True)
            runs[variant] = burst(group, task, scale.burst_tasks, scale.rate)
    for variant, task, column in VARIANTS:
        run, ours = runs[variant], variant in OURS
        n, w, m = run["limit"], run["window"], run["tasks"]
        slide, aligned = max_in_window(run["times"], w) / n, max_in_aligned_windows(run["times"], w) / n
        res.add("1 violation", "max in any window / limit", variant, f"{slide:.2f}", "<= 1.00", slide <= 1.0,
                f"{m} tasks at {n}/{w:g}s; aligned {aligned:.2f}", judged=variant == "sliding")
        res.cell("window", column, f"{slide:.2f}")
        if variant == "fixed":
            res.add("1 violation", "max in an aligned window / limit", variant, f"{aligned:.2f}", "<= 1.00", aligned <= 1)
            res.cell("aligned", column, f"{aligned:.2f}")
        span = max(run["times"]) - min(run["times"])
        res.add("2 makespan", "first-to-last start / ideal", variant, f"{span / run['ideal']:.3f}",
                "<= 1.05", span / run["ideal"] <= 1.05, f"{span:.2f}s vs ideal {run['ideal']:.2f}s", judged=ours)
        res.cell("makespan", column, f"{span / run['ideal']:.3f}")
        unique = len(set(run["ids"]))
        if task == "builtin":
            res.add("3 re-sends", "re-sends per task", variant, "0 (held in worker)", "", None,
                    f"{unique}/{m} started in time, {len(run['ids']) - unique} dup")
            res.cell("resends", column, "0 (held in worker)")
            continue
        bound, per = (m - n) / m + 0.05, run["denied"] / m
        res.add("3 re-sends", "re-sends per task", variant, f"{per:.2f}", f"<= {bound:.2f}", per <= bound,
                f"{run['denied']} denials", judged=ours)
        res.cell("resends", column, f"{per:.2f}")
        res.add("1 violation", "each task ran exactly once", variant, f"{unique}/{m}, {len(run['ids']) - unique} dup",
                "all, 0 dup", run["complete"] and unique == m == len(run["ids"]))
    res.series["burst"] = {v: {"times": r["times"], "limit": r["limit"], "window": r["window"]} for v, r in runs.items()}
    draw(res.series["burst"], f"{scale.burst_tasks} tasks sent at once, limit {scale.rate}, 2 workers x 2 prefork")


COLORS = {"sliding": "#1f77b4", "fixed": "#ff7f0e", "naive fixed (seed)": "#d62728",
          "naive sliding log": "#9467bd", "celery rate_limit": "#2ca02c"}


def draw(runs: dict[str, Any], title: str) -> None:
    """bench/out/chart.png: above, starts in the trailing window against the limit; below, a row
    per variant of starts per 100 ms with the aligned window boundaries."""
    try:
        import matplotlib
    except ImportError:
        print("no chart: matplotlib is in the bench extra", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [v for v in COLORS if runs.get(v, {}).get("times")]
    limit, window = runs[names[0]]["limit"], runs[names[0]]["window"]
    # each on its own axis: 0 is the aligned boundary before its first start
    rel = {v: [t - math.floor(min(runs[v]["times"]) / window) * window for t in sorted(runs[v]["times"])] for v in names}
    others = [r[-1] for v, r in rel.items() if v != "celery rate_limit"]  # (cut Celery's slow tail)
    horizon = math.ceil(min(max(r[-1] for r in rel.values()), max(others) + 2 * window) / window + 0.25) * window
    fig = plt.figure(figsize=(12, 3.2 + 1.25 * len(names)), dpi=110)
    grid = fig.add_gridspec(1 + len(names), 1, height_ratios=[3.2] + [1.0] * len(names), hspace=0.35)
    top = fig.add_subplot(grid[0])
    xs = [i * 0.01 for i in range(int(horizon / 0.01) + 1)]
    for v in names:
        ys = [bisect_right(rel[v], x) - bisect_right(rel[v], x - window) for x in xs]
        late = f", last start at {rel[v][-1]:.0f}s" if rel[v][-1] > horizon else ""
        top.plot(xs, ys, color=COLORS[v], lw=1.6, label=f"{v} (max {max(ys)}){late}")
    top.axhline(limit, color="black", ls="--", lw=1.2, label=f"limit {limit} per {window:g}s")
    top.axhline(2 * limit, color="grey", ls=":", lw=1.0, label="2 x limit")
    top.set(xlim=(0, horizon), ylim=(0, max(2.3 * limit, top.get_ylim()[1])), ylabel=f"starts in the last {window:g}s",
            title=title)
    top.legend(loc="upper right", fontsize=8, ncol=2)
    top.grid(alpha=0.3)
    bins = int(horizon / 0.1)
    counts = {v: [bisect_left(rel[v], (i + 1) * 0.1) - bisect_left(rel[v], i * 0.1) for i in range(bins)] for v in names}
    cap = max(max(c, default=0) for c in counts.values())
    for row, v in enumerate(names, start=1):
        ax = fig.add_subplot(grid[row], sharex=top)
        ax.bar([i * 0.1 for i in range(bins)], counts[v], width=0.1, align="edge", color=COLORS[v], edgecolor="none")
        for k in range(int(horizon / window) + 1):
            ax.axvline(k * window, color="black", lw=0.6, alpha=0.5)
        ax.set(ylim=(0, cap * 1.15 + 1))
        ax.set_ylabel("per 100ms", fontsize=8)
        ax.text(0.005, 0.92, v, transform=ax.transAxes, fontsize=9, va="top", fontweight="bold")
        ax.tick_params(labelsize=8)
        if row < len(names):
            plt.setp(ax.get_xticklabels(), visible=False)
    fig.axes[-1].set_xlabel("seconds from the window boundary before the first start "
                            "(vertical lines: aligned window boundaries)")
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / "chart.png", bbox_inches="tight")
    plt.close(fig)


def run_slow(res: Results, scale: Any, tasks: int = 30, rate: str = "10/s") -> None:
    spans: dict[int, list[float]] = {0: [], 100: []}
    most = 0
    with redis_server() as server:
        store = server.url
        for round_ in range(scale.slow_rounds):
            for delay, got in spans.items():
                proxy = SlowProxy(store, delay).start()
                try:
                    with running(new_prefix(f"slow{delay}"), server, store=proxy.url, records=store, count=1,
                                 concurrency=4, env={"BENCH_RATE": rate}) as group:
                        label = f"slow-{delay}-{round_}"
                        for _ in range(tasks):
                            group.send("sliding", label)
                        if not waited(lambda label=label, g=group: g.started(label) >= tasks, 120):
                            raise RuntimeError(f"{group.started(label)} of {tasks} started at {delay} ms")
                        times = sorted(s["t"] for s in group.starts(label))
                        got.append(times[-1] - times[0])
                        most = max(most, max_in_window(times, 0.98))
                finally:
                    proxy.stop()
    ratios = [fast / slow for fast, slow in zip(spans[0], spans[100])]
    res.add("13 slow store", "pace at 100 ms / pace at 0 ms (first-to-last start, side by side)", "sliding",
            f"{min(ratios):.2f}", ">= 0.8", min(ratios) >= 0.8 and most <= 10,
            f"per round: {', '.join(f'{r:.2f}' for r in ratios)}; first to last at 0 ms "
            f"{', '.join(f'{s:.2f}s' for s in spans[0])}, at 100 ms {', '.join(f'{s:.2f}s' for s in spans[100])}; "
            f"{tasks} tasks at {rate}, most starts in any 0.98 s: {most} (limit 10)")


NB_SEC, QUOTA, B_TASKS, B_AFTER, BIG = "10 noisy neighbour", "100/h", 10, 3.0, 100_000
#: name, task, how A's quota is spent, CT_CHECK_AT_PUBLISH, run beside a flood of BIG too
NEIGHBOURS = (("celery_throttle", "neighbour", "ours", "1", True),
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
        for name, task, spent, check, big in NEIGHBOURS:
            if flood < BIG or big:
                print(f"  noisy neighbour: {name}, flood of {flood:,} ...", flush=True)
                runs.append(neighbour_run(name, task, spent, check, flood))
    for run in runs:
        lat, n, ours = run["latency"], f"{run['flood']:,}", run["name"] == "celery_throttle"
        value = f"p50 {percentile(lat, 0.5):.2f}s, max {lat[-1]:.2f}s" if len(lat) == B_TASKS else \
            f"{len(lat)}/{B_TASKS} started"
        res.add(NB_SEC, f"flood of {n}: B's start after its send", run["name"], value, "p50 <= 1s",
                len(lat) == B_TASKS and percentile(lat, 0.5) <= 1.0,
                f"B's {B_TASKS} sent {B_AFTER:g}s after A's flood was published (in {run['publish']:.1f}s)", ours)
        done = f"{run['flood_s']:.1f}s" if run["flood_s"] is not None else f"not by the end: {run['done']:,}"
        res.add(NB_SEC, f"flood of {n}: all of A's tasks turned away (or ran)", run["name"], done, "", None,
                f"after the flood was published; turned away at publish: {run['at_publish']:,}")
        res.errors(f"noisy neighbour, {run['name']}, {n}", run["errors"])
    for column, name in (("sliding", "celery_throttle"), ("naive sliding log", "naive sliding log")):
        got = [r["latency"] for r in runs if r["name"] == name]
        res.cell("neighbour", column, " / ".join(f"{percentile(lat, 0.5):.2f} s" if len(lat) == B_TASKS else
                                                 f"{len(lat)} of {B_TASKS}" for lat in got))
