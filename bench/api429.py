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

Section 16 (``adapt``, issue 29): adaptive limits against an API whose limit per account is
unknown to the client and moves: at most 50 calls in any 1 s for the first phase (20 s; 6 s at
``--quick``) from the account's first call, then 20, then 80 until every call is in (a
sliding window of the calls it accepted). A refused call gets 429 with ``Retry-After: 1``:
whole seconds, as HTTP has it (a real API with a 1 s window says the same, or ``0``, or a
date; a finer hint only in headers of its own, such as ``retry-after-ms`` or
``x-ratelimit-reset``). Clients (bench/app.py's ``adapt_*``), each on a redis-server and 2
workers x 4 processes of its own, its calls sent at once by a producer process, one client
at a time (side by side, 5 clients on 2 cores ran at about half the API's limits, the
oracle too): ``@throttle("100/s", adapt=True)`` raising ``Backoff`` on a 429 (the declared
100/s, above every limit of the API, a ceiling), today's ``Backoff`` at ``100/s`` (a 429
pauses the scope 1 s), Celery's ``rate_limit="50/s"`` on each of 2 workers retrying after
``Retry-After``, the oracle (``@throttle("50/s")``, set by the bench to the API's limit
with ``set_limit`` as it changes, ``Backoff`` on a 429), and at full scale
``adapt=Adapt(decrease=0.7, growth=0.005)``. Reported: 429s per 100 calls, makespan (first
send to last 200) against the oracle's and the fastest possible (the API's limit
integrated over time), each call once; and where the 429s and the time went.
"""

from __future__ import annotations

import math
import random
import threading
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


# -- 16: adaptive limits (issue 29): an API whose limit moves, unknown to the client --------
ADAPT_SEC = "16 adaptive limits"
#: The API's limit per account (calls in any 1 s), phase by phase from its first call; the last lasts.
ADAPT_LIMITS = (50, 20, 80)
#: The targets against the oracle: 429s per 100 calls at most this many times its own, makespan at most this share.
ADAPT_429S, ADAPT_SPAN = 2.0, 1.15
#: 429s this close after a change of the API's limit (s) are counted as the change's.
ADAPT_NEAR = 2.0


def adapt_clients(extra: bool) -> tuple[Any, ...]:
    from bench.llm import Variant

    clients = (Variant('@throttle("100/s", adapt=True), Backoff on a 429', "adapt_learning", concurrency=4),
               Variant('today\'s Backoff: @throttle("100/s"), Backoff on a 429 (pauses it 1 s)', "adapt_backoff",
                       concurrency=4),
               Variant('Celery rate_limit="50/s" per worker, retry(countdown=Retry-After)', "adapt_builtin",
                       concurrency=4),
               Variant('the oracle: @throttle("50/s"), set_limit to each limit as it changes, Backoff on a 429',
                       "adapt_oracle", concurrency=4))
    more = (Variant('@throttle("100/s", adapt=Adapt(decrease=0.7, growth=0.005)), Backoff on a 429', "adapt_fast",
                    concurrency=4),)
    return clients + (more if extra else ())


def limit_at(t: float, phase: float) -> int:
    """The API's limit ``t`` s after an account's first call."""
    return ADAPT_LIMITS[min(max(int(t // phase), 0), len(ADAPT_LIMITS) - 1)]


def moving_api(phase: float) -> tuple[Api, dict[str, float]]:
    """The API, and each account's first call (when its schedule began): per account, at
    most :func:`limit_at` accepted calls in any 1 s (a sliding window of the calls it
    accepted, this one included; a refused call is not counted); a refused call gets 429
    with ``Retry-After: 1``."""
    from collections import deque

    firsts: dict[str, float] = {}
    taken: dict[str, Any] = {}
    lock = threading.Lock()

    def decide(path: str, q: dict[str, str]) -> tuple[int, int, float, float]:
        with lock:
            now = time.time()
            first, window = firsts.setdefault(q["account"], now), taken.setdefault(q["account"], deque())
            while window and window[0] <= now - 1.0:
                window.popleft()
            if len(window) < limit_at(now - first, phase):
                window.append(now)
                return 200, 0, 0.0, 0.0
        return 429, 0, 1.0, 0.0

    return Api(decide), firsts


def fastest(calls: int, phase: float) -> float:
    """Seconds from an account's first call until the API could have taken ``calls``: its
    limit integrated over time (a sliding window lets a full second's calls in at once at
    the start: a client could end up to 1 s sooner)."""
    at, left = 0.0, float(calls)
    for i, limit in enumerate(ADAPT_LIMITS):
        span = phase if i < len(ADAPT_LIMITS) - 1 else math.inf
        if left <= limit * span:
            return at + left / limit
        at, left = at + span, left - limit * span
    raise AssertionError("the last phase lasts")


def watching(firsts: dict[str, float], phase: float) -> Any:
    """``drive``'s ``on_start``: the oracle's limit set to the API's as it changes, and each
    throttled client's level and pause read every 0.25 s (``run["levels"]``: s after the
    account's first call, the share of the declared rate in force, paused)."""
    def on_start(runs: list[dict[str, Any]]) -> Any:
        from bench.app import app as bench_app
        from celery_throttle import Throttle

        stop, threads, ctls = threading.Event(), [], []

        def oracle(run: dict[str, Any], ctl: Any, scope: str) -> None:
            while not stop.is_set() and run["label"] not in firsts:
                time.sleep(0.002)
            for k, limit in list(enumerate(ADAPT_LIMITS))[1:]:
                if stop.wait(max(0.0, firsts.get(run["label"], 0.0) + k * phase - time.time())):
                    return
                ctl.set_limit(scope, [f"{limit}/s"])
                run["set_at"].append((round(time.time() - firsts[run["label"]], 3), limit))

        def sample(run: dict[str, Any], ctl: Any, scope: str) -> None:
            while not stop.wait(0.25):
                first = firsts.get(run["label"])
                if first is None:
                    continue
                try:
                    status = ctl.status(scope)
                except Exception:  # noqa: BLE001, S112 - a sample missed is a gap in the series
                    continue
                paused = status.paused_until is not None and status.paused_until > time.time()
                run["levels"].append((round(time.time() - first, 2),
                                      None if status.adaptive is None else round(status.adaptive.share, 3), paused))

        for run in runs:
            run["levels"], run["set_at"] = [], []
            if run["variant"].task == "adapt_builtin":
                continue
            ctl = Throttle(bench_app, {"redis_url": urls(run["server"])[0], "key_prefix": run["group"].prefix})
            ctls.append(ctl)
            scope = f"bench.app.{run['variant'].task}"
            jobs = [sample] + ([oracle] if run["variant"].task == "adapt_oracle" else [])
            threads += [threading.Thread(target=job, args=(run, ctl, scope), daemon=True) for job in jobs]
        for thread in threads:
            thread.start()

        def stopped() -> None:
            stop.set()
            for thread in threads:
                thread.join(5)
            for ctl in ctls:
                ctl.close()
        return stopped
    return on_start


def run_adapt(res: Results, scale: Any) -> None:
    from bench.llm import drive

    calls, phase, started = scale.adapt_calls, scale.adapt_phase, time.time()
    best, runs, firsts = fastest(calls, phase), [], {}
    print(f"  adapt: {calls} calls per client, limits {' -> '.join(map(str, ADAPT_LIMITS))}/s changing every "
          f"{phase:g} s (fastest possible {best:.1f} s) ...", flush=True)
    for client in adapt_clients(scale.adapt_extra):  # (one at a time: side by side, 2 cores were the limit)
        api, first = moving_api(phase)
        runs += drive([client], calls, None, 2 * best + 60, api=api, on_start=watching(first, phase), say="adapt")
        firsts.update(first)
    report_adapt(res, runs, firsts, calls, phase, best, time.time() - started)


def phase_of(t: float, phase: float) -> int:
    return min(max(int(t // phase), 0), len(ADAPT_LIMITS) - 1)


def climb(accepted: list[float], since: float, share: float = 0.9) -> float:
    """Seconds from ``since`` until the accepted calls of the trailing second first reached
    ``share`` of the last phase's limit (nan: never)."""
    need = math.ceil(share * ADAPT_LIMITS[-1])
    ts = [t for t in accepted if t >= since]
    for i in range(need - 1, len(ts)):
        if ts[i] - ts[i - need + 1] < 1.0:
            return ts[i] - since
    return math.nan


def anatomy(run: dict[str, Any], first: float, phase: float) -> dict[str, Any]:
    """Where a client's time and 429s went, from the API's log: per phase, the calls accepted
    against what the API allowed in it (the last phase: until the client's last 200), the
    429s within ADAPT_NEAR s after a change against the rest, pauses, the climb to 90 % of
    the last limit; per second, the calls accepted and refused, and the level sampled."""
    arr = sorted(run["tally"], key=lambda a: a.at)
    ok = [a.at - first for a in arr if a.status == 200]
    refused = [a.at - first for a in arr if a.status == 429]
    end = max(ok, default=0.0)
    last = len(ADAPT_LIMITS) - 1
    phases = []
    for k in range(len(ADAPT_LIMITS)):
        lo, hi = k * phase, (k + 1) * phase if k < last else math.inf
        phases.append({"accepted": sum(lo <= t < hi for t in ok), "refused": sum(lo <= t < hi for t in refused),
                       "allowed": round(ADAPT_LIMITS[k] * max(min(hi, end) - lo, 0.0))})
    near = sum(any(0 <= t - k * phase < ADAPT_NEAR for k in range(1, len(ADAPT_LIMITS))) or t < ADAPT_NEAR
               for t in refused)
    seconds = math.ceil(end) + 1
    per_s = [[0, 0] for _ in range(seconds)]
    for t, status in ((a.at - first, a.status) for a in arr):
        if 0 <= t < seconds:
            per_s[int(t)][status != 200] += 1
    levels: dict[int, float | None] = {}
    for t, share, _ in run.get("levels", []):
        levels.setdefault(int(t), share)
    samples = run.get("levels", [])
    paused = sum(1 for *_, p in samples if p) / len(samples) * (samples[-1][0] - samples[0][0]) if len(samples) > 1 \
        else 0.0
    return {"phases": phases, "near": near, "steady": len(refused) - near, "per_s": per_s, "levels": levels,
            "climb": climb(ok, (len(ADAPT_LIMITS) - 1) * phase), "paused_s": paused,
            "offset": first - run["t0"]}


def figures(run: dict[str, Any]) -> tuple[float, float, str]:
    """429s per 100 calls accepted, makespan (a client not done: to its last 200 so far), and
    how it ended when not done (else '')."""
    accepted = sum(a.status == 200 and bool(a.answered) for a in run["tally"])
    ended = "" if run["done_at"] else f"not done: {accepted} of {len(run['ids'])} calls in time"
    return run["refused"] * 100 / max(accepted, 1), run["makespan"], ended


def report_adapt(res: Results, runs: list[dict[str, Any]], firsts: dict[str, float], calls: int, phase: float,
                 best: float, elapsed: float) -> None:
    by = {r["variant"].task: r for r in runs}
    o429, ospan, _ = figures(by["adapt_oracle"])
    limits = " → ".join(f"{x}/s" for x in ADAPT_LIMITS)
    lines = [(f"An API whose limit per account moves {limits}, every {phase:g} s from the account's first call "
              f"(the last as long as needed); a 429 says Retry-After: 1. {calls} calls per client, sent at once, "
              f"2 workers x 4 processes each, one client at a time ({elapsed:.0f} s). Fastest possible: {best:.1f} s (the "
              f"limit integrated over time)."), "",
             ("| client | 429s per 100 calls accepted | makespan | / the oracle's | / fastest possible | 429s within "
              f"{ADAPT_NEAR:g} s after a change / the rest | accepted / allowed per phase | 90 % of "
              f"{ADAPT_LIMITS[-1]}/s reached after | paused | each call once |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        v, label = run["variant"], run["label"]
        per100, span, ended = figures(run)
        more = "> " if ended else ""
        shape = anatomy(run, firsts.get(label, run["t0"]), phase)
        run["anatomy"] = shape
        learner = v.task in ("adapt_learning", "adapt_fast")
        target = v.task == "adapt_learning"
        res.add(ADAPT_SEC, "429s per 100 calls", v.name, f"{per100:.1f}",
                f"<= {ADAPT_429S:g} x the oracle's ({ADAPT_429S * o429:.1f})" if target else "",
                per100 <= ADAPT_429S * o429 if target else None,
                f"{len(run['tally'])} requests for {calls} calls; per 100 calls accepted")
        res.add(ADAPT_SEC, "makespan / the oracle's", v.name,
                f"{more}{span:.1f} s / {ospan:.1f} s = {more}{span / ospan:.3f}", f"<= {ADAPT_SPAN:g}" if target else "",
                span / ospan <= ADAPT_SPAN and not ended if target else None,
                (f"{ended}; " if ended else "") + f"/ fastest possible ({best:.1f} s): {more}{span / best:.3f}; sends "
                f"took {run['send_s']:.1f} s; first call {shape['offset']:.2f} s after the first send")
        res.add(ADAPT_SEC, "every call got exactly one 200", v.name, "yes" if run["once"] else "NO", "yes", run["once"])
        per_phase = " / ".join(f"{p['accepted']}/{p['allowed']}" for p in shape["phases"])
        reached = "–" if math.isnan(shape["climb"]) else f"{shape['climb']:.1f} s"
        paused = "–" if v.task == "adapt_builtin" else f"{shape['paused_s']:.1f} s"
        lines.append(f"| {v.name} | {per100:.1f} | {more}{span:.1f} s{f' ({ended})' if ended else ''} | "
                     f"{more}{span / ospan:.3f} | {more}{span / best:.3f} | "
                     f"{shape['near']} / {shape['steady']} | {per_phase} | {reached} | {paused} | "
                     f"{'yes' if run['once'] else 'NO'} |")
        if learner or v.task == "adapt_oracle":
            series = " ".join(f"{a}" + (f"/{r}" if r else "") + (f"@{shape['levels'][s]:.2f}"
                                                                  if shape["levels"].get(s) is not None else "")
                              for s, (a, r) in enumerate(shape["per_s"]))
            res.notes.append(f"adapt, {v.name}: per second from the account's first call, accepted[/refused]"
                             f"[@level sampled]: {series}" + (f"; limits set at {run['set_at']}" if run["set_at"] else ""))
        if run["errors"]:
            res.notes.append(f"adapt, {v.name}: worker log errors: " + " | ".join(run["errors"][:3]))
    res.table("adapt", "\n".join(lines))
    cells = {}
    for task, run in by.items():
        per100, span, ended = figures(run)
        cells[task] = f"{per100:.1f}, {'> ' if ended else ''}{span / ospan:.2f}" + (f" ({ended})" if ended else "")
    res.cell("adapt", "sliding", f"`adapt=True`: {cells['adapt_learning']}; today's `Backoff`: {cells['adapt_backoff']}; "
                                 f"the oracle: {cells['adapt_oracle']}")
    res.cell("adapt", "Celery `rate_limit`", cells["adapt_builtin"])
    res.series["adapt"] = {r["variant"].name: {"first": firsts.get(r["label"]), "t0": r["t0"], "levels": r["levels"],
                                               "set_at": r["set_at"],
                                               "arrivals": [(round(a.at - firsts.get(r["label"], r["t0"]), 4), a.status)
                                                            for a in r["tally"]]} for r in runs}
