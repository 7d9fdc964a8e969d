"""Sections 11 (429s from an API of at most 10 calls in any 1 s per account) and 16 (``adapt``: its limit moves).

Both run bench/llm.py's ``drive`` against :func:`moving_api`. 11: bench/app.py's ``api_*`` clients (a
429 retried after ``Retry-After``), one at a time, a batch sent at once: 429s per 100 tasks, each once.
16: at most 50 calls in any 1 s per account for a phase, then 20, then 80; clients one at a time
(:data:`ADAPT_CLIENTS`) against the oracle told each limit, and the fastest possible.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from bench.common import Api, Results, md, yes
from bench.llm import Variant, drive

SEC, PER_SECOND = "11 API 429s", 10
#: task -> (client shown, its column of the headline table; the first is judged against no 429)
CLIENTS = {"api_sliding": ('@throttle("10/s") sliding', "sliding"),
           "api_fixed": ('@throttle("10/s", algorithm="fixed")', "fixed"),
           "api_builtin": ('Celery rate_limit="10/s"', "Celery `rate_limit`"), "api_plain": ("no throttle", "")}


def run_api429(res: Results, scale: Any) -> None:
    tasks, started, lines = scale.api_tasks, time.time(), []
    ideal = (tasks - 1) // PER_SECOND  # (a moving window lets the first 10 in at once)
    for task, (name, column) in CLIENTS.items():  # (one at a time: 2 cores)
        run = drive([Variant(name, task)], tasks, None, 3 * ideal + 30, api=moving_api(math.inf, (PER_SECOND,))[0],
                    say="api429")[0]
        per100, span = run["refused"] * 100 / tasks, run["makespan"] / ideal
        res.add(SEC, "429s per 100 tasks, an API of 10 calls in any 1 s", name, f"{per100:.1f}", "0", not run["refused"],
                f"{len(run['tally'])} requests; makespan / ideal {span:.2f}", task == "api_sliding")
        res.add(SEC, "every task got exactly one 200", name, yes(run["once"]), "yes", run["once"])
        res.errors(f"api429, {name}", run["errors"])
        lines.append(f"| {name} | {per100:.1f} | {run['makespan']:.1f} s / {ideal} s = {span:.2f} | {yes(run['once'])} |")
        if column:
            res.cell("api429", column, f"{per100:.1f}")
    res.table("api429", f"An API of at most {PER_SECOND} accepted calls in any 1 s per account, a 429 saying "
                        f"Retry-After: 1; {tasks} tasks sent at once per client, 2 workers x 2 processes, one client "
                        f"at a time ({time.time() - started:.0f} s); the ideal: the first 10 at once, then 10 a "
                        "second\n\n" + md("| client | 429s per 100 tasks | makespan / ideal | each task once |", lines))


# -- 16: adaptive limits (issue 29): an API whose limit moves, unknown to the client --------
#: The API's limit per account (calls in any 1 s), phase by phase from its first call (the last lasts); the
#: targets (issue 29: at most this many 429s per 100 calls, a makespan at most this share of the oracle's).
ADAPT_SEC, ADAPT_LIMITS, ADAPT_429S, ADAPT_SPAN = "16 adaptive limits", (50, 20, 80), 2.0, 1.15
#: task -> the client shown
ADAPT_CLIENTS = {"adapt_learning": '@throttle("100/s", adapt=True), Backoff on a 429',
                 "adapt_backoff": 'today\'s Backoff: @throttle("100/s"), Backoff on a 429 (pauses it 1 s)',
                 "adapt_builtin": 'Celery rate_limit="50/s" per worker, retry(countdown=Retry-After)',
                 "adapt_oracle": 'the oracle: @throttle("50/s"), set_limit to each limit as it changes, Backoff on a 429'}


def moving_api(phase: float, limits: tuple[int, ...] = ADAPT_LIMITS) -> tuple[Api, dict[str, float]]:
    """The API, and each account's first call: at most the phase's limit of accepted calls in any
    1 s (a refused call not counted), phase by phase from the first; a 429 says ``Retry-After: 1``."""
    firsts: dict[str, float] = {}
    taken: dict[str, deque[float]] = {}
    lock = threading.Lock()

    def decide(path: str, q: dict[str, str]) -> tuple[int, int, float, float]:
        with lock:
            now = time.time()
            first, window = firsts.setdefault(q["account"], now), taken.setdefault(q["account"], deque())
            while window and window[0] <= now - 1.0:
                window.popleft()
            if len(window) < limits[min(max(int((now - first) // phase), 0), len(limits) - 1)]:
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


#: How often the oracle reads the API's limit (it sets it on the store when it changed).
ORACLE_TICK = 0.1


def oracle(limit: Callable[[float], float], firsts: dict[str, float]) -> Any:
    """``drive``'s ``on_start``: the oracle's limit set to the API's, ``limit(t)`` at t s from the
    account's first call, as it changes (read every ORACLE_TICK)."""
    def on_start(runs: list[dict[str, Any]]) -> Any:
        from bench.app import app as bench_app
        from celery_throttle import Throttle

        stop, threads, ctls = threading.Event(), [], []

        def follow(run: dict[str, Any], ctl: Any, scope: str) -> None:
            told = math.floor(limit(0.0))
            ctl.set_limit(scope, [f"{told}/s"])
            while not stop.wait(ORACLE_TICK):
                first = firsts.get(run["label"])
                now = math.floor(limit(0.0 if first is None else time.time() - first))
                if now != told:
                    ctl.set_limit(scope, [f"{now}/s"])
                    told = now
                    run["set_at"].append((round(time.time() - (first or time.time()), 2), now))

        for run in runs:
            run["set_at"] = []
            if run["variant"].task == "adapt_oracle":
                ctls.append(ctl := Throttle(bench_app, {"redis_url": run["server"].url,
                                                        "key_prefix": run["group"].prefix}))
                threads.append(threading.Thread(target=follow, args=(run, ctl, "bench.app.adapt_oracle"), daemon=True))
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


def stepped(phase: float) -> Callable[[float], float]:
    """Section 16's limit at t s from the first call: ADAPT_LIMITS, a phase each (the last lasts)."""
    return lambda t: ADAPT_LIMITS[min(max(int(t // phase), 0), len(ADAPT_LIMITS) - 1)]


def run_adapt(res: Results, scale: Any) -> None:
    calls, phase, started = scale.adapt_calls, scale.adapt_phase, time.time()
    best, runs, firsts = fastest(calls, phase), [], {}
    print(f"  adapt: {calls} calls per client, limits {' -> '.join(map(str, ADAPT_LIMITS))}/s changing every "
          f"{phase:g} s (fastest possible {best:.1f} s) ...", flush=True)
    for task, name in ADAPT_CLIENTS.items():  # (one at a time: side by side, 2 cores were the limit)
        api, first = moving_api(phase)
        runs += drive([Variant(name, task, concurrency=4)], calls, None, 2 * best + 60, api=api,
                      on_start=oracle(stepped(phase), first), say="adapt")
        firsts.update(first)
    report_adapt(res, runs, firsts, calls, phase, best, time.time() - started)


def phases(run: dict[str, Any], first: float, phase: float) -> list[tuple[int, int]]:
    """Per phase, the calls accepted and what the API allowed (the last: to the client's last 200)."""
    ok = sorted(a.at - first for a in run["tally"] if a.status == 200)
    end, last = max(ok, default=0.0), len(ADAPT_LIMITS) - 1
    return [(sum(k * phase <= t < hi for t in ok), round(limit * max(min(hi, end) - k * phase, 0.0)))
            for k, limit in enumerate(ADAPT_LIMITS) for hi in [(k + 1) * phase if k < last else math.inf]]


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
        first = firsts.get(run["label"], run["t0"])
        res.add(ADAPT_SEC, "429s per 100 calls", v.name, f"{per100:.1f}", f"<= {ADAPT_429S:g} (the oracle: {o429:.1f})",
                per100 <= ADAPT_429S, f"{len(run['tally'])} requests for {calls} calls; per 100 calls accepted", target)
        res.add(ADAPT_SEC, "makespan / the oracle's", v.name,
                f"{more}{span:.1f} s / {ospan:.1f} s = {more}{span / ospan:.3f}", f"<= {ADAPT_SPAN:g}",
                span / ospan <= ADAPT_SPAN and not ended,
                (f"{ended}; " if ended else "") + f"/ fastest possible ({best:.1f} s): {more}{span / best:.3f}; sends "
                f"took {run['send_s']:.1f} s; first call {first - run['t0']:.2f} s after the first send", target)
        res.add(ADAPT_SEC, "every call got exactly one 200", v.name, yes(run["once"]), "yes", run["once"])
        lines.append(f"| {v.name} | {per100:.1f} | {more}{span:.1f} s{f' ({ended})' if ended else ''} | "
                     f"{more}{span / ospan:.3f} | {more}{span / best:.3f} | "
                     f"{' / '.join(f'{a}/{n}' for a, n in phases(run, first, phase))} | {yes(run['once'])} |")
        if run["set_at"]:
            res.notes.append(f"adapt, {v.name}: limits set at {run['set_at']} (s after the account's first call)")
        res.errors(f"adapt, {v.name}", run["errors"])
        cells[v.task] = f"{per100:.1f}, {more}{span / ospan:.2f}" + (f" ({ended})" if ended else "")
    res.table("adapt", (
        f"An API whose limit per account moves {' → '.join(f'{x}/s' for x in ADAPT_LIMITS)}, every {phase:g} s from the "
        f"account's first call (the last as long as needed); a 429 says Retry-After: 1. {calls} calls per client, sent "
        f"at once, 2 workers x 4 processes each, one client at a time ({elapsed:.0f} s). Fastest possible: {best:.1f} s "
        "(the limit integrated over time).\n\n") + md(
        "| client | 429s per 100 calls accepted | makespan | / the oracle's | / fastest possible "
        "| accepted / allowed per phase | each call once |", lines))
    res.cell("adapt", "sliding", f"`adapt=True`: {cells['adapt_learning']}; today's `Backoff`: {cells['adapt_backoff']}; "
                                 f"the oracle: {cells['adapt_oracle']}")
    res.cell("adapt", "Celery `rate_limit`", cells["adapt_builtin"])
