"""Sections 11 (429s from an API of ``10 per 1 second`` per account) and 16 (``adapt``: its limit moves).

11: ``limits``' strategies in a fake API (moving, fixed, moving with 0-100 ms jitter); clients
(bench/app.py's ``api_*``) retry a 429 after ``Retry-After``; a batch sent at once, ``warm`` (20 tasks
ended 1.5 s before) or ``cold``: 429s per 100 tasks, makespan / ideal, the closest 11 accepted, each once.
16: at most 50 calls in any 1 s per account for a phase, then 20, then 80; clients one at a time
(:data:`ADAPT_CLIENTS`) against the oracle told each limit, and the fastest possible.
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
from collections import deque
from typing import Any

from bench.common import Api, Arrival, Results, md, new_prefix, produce, running, yes
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
                api = limiter_api(redis.url, "ct-bench", server)
                try:
                    with running(new_prefix("api"), redis, env={"BENCH_API_URL": api.url}) as group:
                        for task in tasks:
                            print(f"  api429 [{time.time() - started:.0f}s]: {CLIENTS[task][0]} vs {server}, {phase}"
                                  " ...", flush=True)
                            runs.append(batch(api, group, task, server, phase, scale.api_tasks))
                finally:
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
                f"{run['429']:.1f}", "0", run["429"] == 0,
                f"{len(arr)} requests; makespan / ideal {run['span']:.2f}; closest 11 accepted {closest(arr):.3f}s; "
                f"most 200s in any 1 s {max_in_window([a.at for a in arr if a.status == 200], 1.0)}", target)
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
    lines = []
    for phase in ("warm", "cold"):
        for task, (name, _) in CLIENTS.items():
            by = {r["server"]: r for r in runs if r["task"] == task and r["phase"] == phase}
            if by:
                cells = [" / ".join(fmt(by[s]) if s in by else "-" for s in SERVERS)
                         for fmt in (lambda r: f"{r['429']:.1f}", lambda r: f"{r['span']:.2f}",
                                     lambda r: f"{closest(r['arrivals']):.3f}")]
                lines.append(f"| {name} | {phase} | {' | '.join(cells)} | {yes(all(r['once'] for r in by.values()))} |")
    res.table("api429", f"API 429s ({tasks} tasks per run, {elapsed:.0f} s):\n\n" + md(
        "| client | run | 429s per 100 tasks: moving / fixed / moving, 0-100 ms delay | makespan / ideal "
        "| closest 11 accepted at the API, s | each task once |", lines))
    res.notes.append("API 429s: limits' moving and fixed windows (Flask-Limiter's strategies) at 10 per 1 second per "
                     "account, on Redis, in a stdlib HTTP server of the bench's process; tasks retry a 429 after "
                     "Retry-After (at least 1 s). Makespan: first send to last 200; ideal: tasks / 10 s.")


# -- 16: adaptive limits (issue 29): an API whose limit moves, unknown to the client --------
#: The API's limit per account (calls in any 1 s), phase by phase from its first call (the last lasts); the
#: targets (issue 29: at most this many 429s per 100 calls, a makespan at most this share of the oracle's);
#: 429s this close after a change of the limit (s) are the change's.
ADAPT_SEC, ADAPT_LIMITS, ADAPT_429S, ADAPT_SPAN, ADAPT_NEAR = "16 adaptive limits", (50, 20, 80), 2.0, 1.15, 2.0
#: task -> the client shown (adapt_fast at full scale only)
ADAPT_CLIENTS = {"adapt_learning": '@throttle("100/s", adapt=True), Backoff on a 429',
                 "adapt_backoff": 'today\'s Backoff: @throttle("100/s"), Backoff on a 429 (pauses it 1 s)',
                 "adapt_builtin": 'Celery rate_limit="50/s" per worker, retry(countdown=Retry-After)',
                 "adapt_oracle": 'the oracle: @throttle("50/s"), set_limit to each limit as it changes, Backoff on a 429',
                 "adapt_fast": '@throttle("100/s", adapt=Adapt(decrease=0.85, growth=0.001)) (the defaults before '
                               '1e736f1), Backoff on a 429'}


def moving_api(phase: float) -> tuple[Api, dict[str, float]]:
    """The API, and each account's first call: at most the phase's limit of accepted calls in any
    1 s (a refused call not counted); a refused call gets 429 with ``Retry-After: 1``."""
    firsts: dict[str, float] = {}
    taken: dict[str, deque[float]] = {}
    lock = threading.Lock()

    def decide(path: str, q: dict[str, str]) -> tuple[int, int, float, float]:
        with lock:
            now = time.time()
            first, window = firsts.setdefault(q["account"], now), taken.setdefault(q["account"], deque())
            while window and window[0] <= now - 1.0:
                window.popleft()
            if len(window) < ADAPT_LIMITS[min(max(int((now - first) // phase), 0), len(ADAPT_LIMITS) - 1)]:
                window.append(now)
                return 200, 0, 0.0, 0.0
        return 429, 0, 1.0, 0.0

    return Api(decide), firsts


def fastest(calls: int, phase: float) -> float:
    """Seconds from the first call until the API could have taken ``calls``: its limit integrated
    over time (a sliding window lets a second's calls in at once: a client could end 1 s sooner)."""
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
                if (first := firsts.get(run["label"])) is None:
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
            if run["variant"].task != "adapt_builtin":
                ctls.append(ctl := Throttle(bench_app, {"redis_url": run["server"].url,
                                                        "key_prefix": run["group"].prefix}))
                jobs = [sample] + ([oracle] if run["variant"].task == "adapt_oracle" else [])
                threads += [threading.Thread(target=job, args=(run, ctl, f"bench.app.{run['variant'].task}"),
                                             daemon=True) for job in jobs]
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
    from bench.llm import Variant, drive

    calls, phase, started = scale.adapt_calls, scale.adapt_phase, time.time()
    best, runs, firsts = fastest(calls, phase), [], {}
    print(f"  adapt: {calls} calls per client, limits {' -> '.join(map(str, ADAPT_LIMITS))}/s changing every "
          f"{phase:g} s (fastest possible {best:.1f} s) ...", flush=True)
    clients = [Variant(name, task, concurrency=4) for task, name in ADAPT_CLIENTS.items()
               if scale.adapt_extra or task != "adapt_fast"]
    for client in clients:  # (one at a time: side by side, 2 cores were the limit)
        api, first = moving_api(phase)
        runs += drive([client], calls, None, 2 * best + 60, api=api, on_start=watching(first, phase), say="adapt")
        firsts.update(first)
    report_adapt(res, runs, firsts, calls, phase, best, time.time() - started)


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
    """Where a client's time and 429s went, from the API's log: per phase, the calls accepted and
    what the API allowed (the last phase: to the client's last 200); the 429s within ADAPT_NEAR s
    after a change, and the rest; per second, the calls accepted and refused, and the level
    sampled; the time paused; the climb to 90 % of the last limit."""
    ok = sorted(a.at - first for a in run["tally"] if a.status == 200)
    refused = [a.at - first for a in run["tally"] if a.status == 429]
    end, last, samples = max(ok, default=0.0), len(ADAPT_LIMITS) - 1, run.get("levels", [])
    phases = [(sum(k * phase <= t < hi for t in ok), round(limit * max(min(hi, end) - k * phase, 0.0)))
              for k, limit in enumerate(ADAPT_LIMITS) for hi in [(k + 1) * phase if k < last else math.inf]]
    near = sum(any(0 <= t - k * phase < ADAPT_NEAR for k in range(1, len(ADAPT_LIMITS))) or t < ADAPT_NEAR
               for t in refused)
    per_s = [[0, 0] for _ in range(math.ceil(end) + 1)]
    for a in run["tally"]:
        if 0 <= a.at - first < len(per_s):
            per_s[int(a.at - first)][a.status != 200] += 1
    paused = sum(p for *_, p in samples) / len(samples) * (samples[-1][0] - samples[0][0]) if len(samples) > 1 else 0.0
    return {"phases": phases, "near": near, "steady": len(refused) - near, "per_s": per_s, "paused_s": paused,
            "levels": {int(t): share for t, share, _ in reversed(samples)}, "climb": climb(ok, last * phase),
            "offset": first - run["t0"]}


def figures(run: dict[str, Any]) -> tuple[float, float, str]:
    """429s per 100 calls accepted, makespan (not done: to its last 200 so far), how it ended when not done."""
    accepted = sum(a.status == 200 and bool(a.answered) for a in run["tally"])
    ended = "" if run["done_at"] else f"not done: {accepted} of {len(run['ids'])} calls in time"
    return run["refused"] * 100 / max(accepted, 1), run["makespan"], ended


def report_adapt(res: Results, runs: list[dict[str, Any]], firsts: dict[str, float], calls: int, phase: float,
                 best: float, elapsed: float) -> None:
    by = {r["variant"].task: r for r in runs}
    o429, ospan, _ = figures(by["adapt_oracle"])
    lines, cells = [], {}
    for run in runs:
        v = run["variant"]
        per100, span, ended = figures(run)
        more, target = "> " if ended else "", v.task == "adapt_learning"
        shape = anatomy(run, firsts.get(run["label"], run["t0"]), phase)
        res.add(ADAPT_SEC, "429s per 100 calls", v.name, f"{per100:.1f}", f"<= {ADAPT_429S:g} (the oracle: {o429:.1f})",
                per100 <= ADAPT_429S, f"{len(run['tally'])} requests for {calls} calls; per 100 calls accepted", target)
        res.add(ADAPT_SEC, "makespan / the oracle's", v.name,
                f"{more}{span:.1f} s / {ospan:.1f} s = {more}{span / ospan:.3f}", f"<= {ADAPT_SPAN:g}",
                span / ospan <= ADAPT_SPAN and not ended,
                (f"{ended}; " if ended else "") + f"/ fastest possible ({best:.1f} s): {more}{span / best:.3f}; sends "
                f"took {run['send_s']:.1f} s; first call {shape['offset']:.2f} s after the first send", target)
        res.add(ADAPT_SEC, "every call got exactly one 200", v.name, yes(run["once"]), "yes", run["once"])
        reached = "–" if math.isnan(shape["climb"]) else f"{shape['climb']:.1f} s"
        paused = "–" if v.task == "adapt_builtin" else f"{shape['paused_s']:.1f} s"
        lines.append(f"| {v.name} | {per100:.1f} | {more}{span:.1f} s{f' ({ended})' if ended else ''} | "
                     f"{more}{span / ospan:.3f} | {more}{span / best:.3f} | {shape['near']} / {shape['steady']} | "
                     f"{' / '.join(f'{a}/{n}' for a, n in shape['phases'])} | {reached} | "
                     f"{paused} | {yes(run['once'])} |")
        if v.task in ("adapt_learning", "adapt_fast", "adapt_oracle"):
            series = " ".join(f"{a}" + (f"/{r}" if r else "") + ("" if (lv := shape["levels"].get(s)) is None else
                                                                  f"@{lv:.2f}") for s, (a, r) in enumerate(shape["per_s"]))
            res.notes.append(f"adapt, {v.name}: per second from the account's first call, accepted[/refused]"
                             f"[@level sampled]: {series}" + (f"; limits set at {run['set_at']}" if run["set_at"] else ""))
        res.errors(f"adapt, {v.name}", run["errors"])
        cells[v.task] = f"{per100:.1f}, {more}{span / ospan:.2f}" + (f" ({ended})" if ended else "")
    res.table("adapt", (
        f"An API whose limit per account moves {' → '.join(f'{x}/s' for x in ADAPT_LIMITS)}, every {phase:g} s from the "
        f"account's first call (the last as long as needed); a 429 says Retry-After: 1. {calls} calls per client, sent "
        f"at once, 2 workers x 4 processes each, one client at a time ({elapsed:.0f} s). Fastest possible: {best:.1f} s "
        "(the limit integrated over time).\n\n") + md(
        "| client | 429s per 100 calls accepted | makespan | / the oracle's | / fastest possible | 429s within "
        f"{ADAPT_NEAR:g} s after a change / the rest | accepted / allowed per phase | 90 % of {ADAPT_LIMITS[-1]}/s "
        "reached after | paused | each call once |", lines))
    res.cell("adapt", "sliding", f"`adapt=True`: {cells['adapt_learning']}; today's `Backoff`: {cells['adapt_backoff']}; "
                                 f"the oracle: {cells['adapt_oracle']}")
    res.cell("adapt", "Celery `rate_limit`", cells["adapt_builtin"])
    res.series["adapt"] = {r["variant"].name: {"first": firsts.get(r["label"]), "t0": r["t0"], "levels": r["levels"],
                                               "set_at": r["set_at"],
                                               "arrivals": [(round(a.at - firsts.get(r["label"], r["t0"]), 4), a.status)
                                                            for a in r["tally"]]} for r in runs}
