"""Sections 1-4 (a burst: violation, makespan, re-sends, the baselines; the chart) and 13 (a slow store).

1-4: ``burst_tasks`` calls of one key sent at once, 60 % into an aligned window (the fixed window's
boundary burst shows), to 2 workers x 2 prefork: ours sliding and fixed, the naive baselines, Celery's
``rate_limit``. 13: 30 tasks at ``10/s`` on 1 worker x 4, the store behind tests/slow_proxy.py (0 or
100 ms late), side by side each round: the pace at 100 ms over the pace at 0 ms (target >= 0.8).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from typing import Any

from bench.common import OUT, Results, new_prefix, running, served
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
