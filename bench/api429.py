"""Section 11: 429s from an API that enforces the published limit, ``10 per 1 second`` per account.

The API (bench/common.py's) limits each account with ``limits``' strategies on Redis (those
Flask-Limiter runs): ``moving`` (at most 10 requests in any second), ``fixed``, and ``jitter``
(moving, each request held 0-100 ms before the limiter: a remote API's network); 200, or 429
with ``Retry-After``. The clients (bench/app.py's ``api_*``) make one request each and retry
a 429; they differ in how they limit themselves. 2 workers x 2 prefork processes; a producer
process sends a batch at once on a fresh account. ``warm``: workers and API running, the
account warmed by 20 tasks that ended 1.5 s before; ``cold``: fresh API and workers.
Reported per run: 429s per 100 tasks, makespan (first send to last 200) / ideal (tasks /
10 s), the closest any 11 accepted requests came (the moving window refuses the 11th within
1 s), whether every task got exactly one 200.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

from bench.common import Api, Arrival, Results, new_prefix, produce, urls, workers
from tests.harness import redis_server, waited
from tests.helpers import max_in_window

SEC, PER_SECOND, WARM_TASKS, WARM_PAUSE = "11 API 429s", 10, 20, 1.5
SERVERS = {"moving": ("moving-window", 0.0, "moving-window server"),
           "fixed": ("fixed-window", 0.0, "fixed-window server"),
           "jitter": ("moving-window", 0.1, "moving-window server, 0-100 ms network delay")}
#: task -> (client shown, its margin: None when not a sliding client of the published rate)
CLIENTS = {"api_sliding": ('@throttle("10/s") sliding (default margin: 20 ms)', 0.02),
           "api_margin_0": ('@throttle("10/s", margin=0)', 0.0),
           "api_margin_05": ('@throttle("10/s", margin=0.05)', 0.05),
           "api_margin_10": ('@throttle("10/s", margin=0.1)', 0.1), "api_9": ('@throttle("9/s") sliding', None),
           "api_fixed": ('@throttle("10/s", algorithm="fixed")', None),
           "api_builtin": ('Celery rate_limit="10/s"', None), "api_plain": ("no throttle", None)}
SLIDING = ("api_sliding", "api_margin_0", "api_margin_05", "api_margin_10")
#: Per server, the clients run warm, and cold (None: all); fewer on the fixed and delayed
#: servers, to keep the section near 10 minutes.
WARM = {"moving": None, "fixed": ("api_sliding", "api_margin_05", "api_fixed", "api_builtin", "api_plain"),
        "jitter": SLIDING}
COLD = {"moving": SLIDING, "fixed": ("api_sliding",), "jitter": ("api_sliding", "api_margin_05")}


def limiter_api(url: str, prefix: str, server: str) -> Api:
    from limits import parse, storage, strategies

    strategy, jitter, _ = SERVERS[server]
    store = storage.RedisStorage(url, key_prefix=f"{prefix}-api-{uuid.uuid4().hex[:6]}")
    lim = (strategies.MovingWindowRateLimiter if strategy == "moving-window" else strategies.FixedWindowRateLimiter)(store)
    item = parse("10 per 1 second")

    def decide(path: str, q: dict[str, str]) -> tuple[int, int, float, float]:
        time.sleep(random.uniform(0, jitter))
        if lim.hit(item, q["account"]):
            return 200, 0, 0.0, 0.0
        return 429, 0, lim.get_window_stats(item, q["account"]).reset_time - time.time(), 0.0

    return Api(decide)


def batch(api: Api, group: Any, task: str, server: str, phase: str, tasks: int) -> dict[str, Any]:
    label = f"{server}-{task}-{phase}-{uuid.uuid4().hex[:4]}"
    if phase == "warm":
        produce(group, {"task": task, "args": [f"{label}-warm", label], "count": WARM_TASKS})
        if not waited(lambda: len(api.answered(f"{label}-warm")) >= WARM_TASKS, 60):
            raise RuntimeError(f"the warm-up of {task} did not end in 60 s")
        time.sleep(WARM_PAUSE)
    sent = produce(group, {"task": task, "args": [label, label], "count": tasks, "ids": True})[0]
    complete = waited(lambda: len(api.answered(label)) >= tasks, tasks / PER_SECOND * 3 + 30)
    time.sleep(0.5)  # a late duplicate would show now
    return {"task": task, "server": server, "phase": phase, "tasks": tasks, "t0": sent["first"],
            "ids": set(sent["ids"]), "arrivals": api.tally(label), "complete": complete}


def closest(arrivals: list[Arrival], n: int = PER_SECOND + 1) -> float:
    """The shortest time any ``n`` accepted requests spanned at the API."""
    ts = sorted(a.at for a in arrivals if a.status == 200)
    return min((ts[i + n - 1] - ts[i] for i in range(len(ts) - n + 1)), default=float("nan"))


def run_api429(res: Results, scale: Any) -> None:
    margins = {m for m in scale.api_margins} | {0.02}
    picked = [t for t, (_, m) in CLIENTS.items() if (m is None and not (scale.quick and t == "api_9")) or m in margins]
    runs, started = [], time.time()
    with redis_server() as redis:
        for server in SERVERS:
            plans = [("cold", [t]) for t in picked if server in scale.api_cold and t in COLD[server]]
            plans.append(("warm", [t for t in picked if WARM[server] is None or t in WARM[server]]))
            for phase, tasks in plans:
                api = limiter_api(urls(redis)[0], "ct-bench", server)
                group = workers(new_prefix("api"), redis, env={"BENCH_API_URL": api.url})
                try:
                    group.start()
                    for task in tasks:
                        print(f"  api429 [{time.time() - started:.0f}s]: {CLIENTS[task][0]} vs {server}, {phase} ...",
                              flush=True)
                        runs.append(batch(api, group, task, server, phase, scale.api_tasks))
                finally:
                    group.stop()
                    api.close()
    report(res, runs, scale.api_tasks, time.time() - started)


def report(res: Results, runs: list[dict[str, Any]], tasks: int, elapsed: float) -> None:
    ideal = tasks / PER_SECOND
    for run in runs:
        arr = run["arrivals"]
        run["429"] = sum(a.status == 429 for a in arr) * 100 / tasks
        run["span"] = (max((a.answered for a in arr if a.answered), default=float("nan")) - run["t0"]) / ideal
        done = [a.task_id for a in arr if a.answered]
        run["once"] = run["complete"] and len(set(done)) == len(done) == tasks and set(done) <= run["ids"]
        target = run["server"] == "moving" and CLIENTS[run["task"]][1] is not None
        res.add(SEC, f"429s per 100 tasks, {SERVERS[run['server']][2]}, {run['phase']}", CLIENTS[run["task"]][0],
                f"{run['429']:.1f}", "0" if target else "", run["429"] == 0 if target else None,
                f"{len(arr)} requests; makespan / ideal {run['span']:.2f}; closest 11 accepted {closest(arr):.3f}s; "
                f"most 200s in any 1 s {max_in_window([a.at for a in arr if a.status == 200], 1.0)}")
        if run["server"] == "moving" and run["phase"] == "warm":
            column = {"api_sliding": "sliding", "api_fixed": "fixed", "api_builtin": "Celery `rate_limit`"}
            if run["task"] in column:
                res.cell("api429", column[run["task"]], f"{run['429']:.1f}")
    bad = [r for r in runs if not r["once"]]
    res.add(SEC, "every task completed exactly once", "all runs", f"{len(runs) - len(bad)}/{len(runs)} runs", "all",
            not bad, "; ".join(f"{r['task']} {r['server']} {r['phase']}" for r in bad))
    for phase in ("cold", "warm"):
        pair = [[r["span"] for r in runs if r["server"] == "moving" and r["phase"] == phase and r["task"] == t]
                for t in ("api_sliding", "api_margin_0")]
        if all(pair):
            ratio = pair[0][0] / pair[1][0]
            res.add(SEC, f"makespan of the default margin / margin=0, moving-window server, {phase}", "sliding 10/s",
                    f"{ratio:.3f}", "<= 1.03", ratio <= 1.03, "one run each, side by side")
    lines = [f"API 429s ({tasks} tasks per run, {elapsed:.0f} s):", "",
             ("| client | run | 429s per 100 tasks: moving / fixed / moving, 0-100 ms delay "
             "| makespan / ideal | closest 11 accepted at the API, s | each task once |"), "|---|---|---|---|---|---|"]
    for phase in ("warm", "cold"):
        for task, (name, _) in CLIENTS.items():
            by = {r["server"]: r for r in runs if r["task"] == task and r["phase"] == phase}
            if by:
                cells = [" / ".join(fmt(by[s]) if s in by else "-" for s in SERVERS)
                         for fmt in (lambda r: f"{r['429']:.1f}", lambda r: f"{r['span']:.2f}",
                                     lambda r: f"{closest(r['arrivals']):.3f}")]
                lines.append(f"| {name} | {phase} | {' | '.join(cells)} | "
                             f"{'yes' if all(r['once'] for r in by.values()) else 'NO'} |")
    res.table("api429", "\n".join(lines))
    res.notes.append("API 429s: limits' moving and fixed windows (Flask-Limiter's strategies) at 10 per 1 second per "
                     "account, on Redis, in a stdlib HTTP server of the bench's process; tasks retry a 429 after "
                     "Retry-After (at least 1 s). Makespan: first send to last 200; ideal: tasks / 10 s.")
