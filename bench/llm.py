"""Section 15b: an LLM-style API whose limits count requests and tokens; the clients' driver.

The API counts a call when it arrives, at its ``Plan``'s tokens: 200 (L s later) if the account's
window then holds it, else 429 with ``Retry-After``. Each client (:func:`drive`): a redis-server, an
account, a producer and 2 workers of its own. ``SWEEP_PLAN``, replies after L = 0..3 s: :data:`SWEEP`
against the fastest compliant makespan (:func:`fastest_any`: exact when it meets the bound), greedy in
call order and :func:`held_greedy`. (Section 15, 60 requests and 10 000 tokens a minute, was dropped
after 7daff28: 15b measures the same clients with replies that take time.)
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from bench.app import MAX_COMPLETION, SWEEP_PLAN, Plan
from bench.common import Api, Results, md, produce, served, yes

SWEEP_SEC, SWEEP_TARGET = "15b llm sweep", 1.05


@dataclass(frozen=True)
class Variant:
    name: str
    task: str  # in bench/app.py
    no_429: bool = False  # a target of 0 429s
    latency: float = 0.0  # seconds before the API sends a 200
    concurrency: int = 2


SWEEP = (Variant('@throttle("20/10s", "4000 tokens/10s", cost={"tokens": prompt + 200}), charge(tokens=n)',
                 "prompt_settled", no_429=True, concurrency=4),
         Variant('Celery rate_limit="1/s" per worker', "builtin_10s", concurrency=4),
         Variant("by hand: limits moving window, requests and prompt + 200 tokens", "by_hand", concurrency=4))


class Window:
    """One account's accepted calls of its plan's last window: the API's own rule."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.calls, self.tokens = plan, deque[tuple[float, int]](), 0

    def left(self) -> dict[str, str]:
        """What the API says is left of its window, as OpenAI's headers say it."""
        return {"x-ratelimit-limit-requests": str(self.plan.requests), "x-ratelimit-limit-tokens": str(self.plan.tokens),
                "x-ratelimit-remaining-requests": str(max(self.plan.requests - len(self.calls), 0)),
                "x-ratelimit-remaining-tokens": str(max(self.plan.tokens - self.tokens, 0))}

    def admit(self, now: float, cost: int) -> float:
        """Count the call and return 0, or return the seconds until it would fit."""
        while self.calls and self.calls[0][0] <= now - self.plan.window:
            self.tokens -= self.calls.popleft()[1]
        if len(self.calls) + 1 <= self.plan.requests and self.tokens + cost <= self.plan.tokens:
            self.calls.append((now, cost))
            self.tokens += cost
            return 0.0
        count, held = len(self.calls), self.tokens  # walk the oldest out until both have room
        for at, used in self.calls:
            count, held = count - 1, held - used
            if count + 1 <= self.plan.requests and held + cost <= self.plan.tokens:
                return at + self.plan.window - now
        return self.plan.window


def llm_api(plans: dict[str, tuple[Plan, float]]) -> Api:
    """The API: each account's (plan, latency)."""
    windows: dict[str, Window] = {}
    lock = threading.Lock()

    def decide(path: str, q: dict[str, str]) -> tuple[int, int, float, float]:
        plan, latency = plans[q["account"]]
        cost = plan.cost(int(q["i"]))
        with lock:
            window = windows.setdefault(q["account"], Window(plan))
            wait = window.admit(time.time(), cost)
            left = window.left()
        return (429, cost, wait, 0.0, left) if wait else (200, cost, 0.0, latency, left)

    return Api(decide)


def greedy(plan: Plan, order: Sequence[int], processes: int, latency: float) -> float:
    """The makespan of a client that knew every call's tokens and sent each, in ``order``, as
    soon as one of ``processes`` was free and the API's window had room."""
    window, at, free = Window(plan), 0.0, [0.0] * processes
    for i in order:
        at = max(at, heapq.heappop(free))
        while wait := window.admit(at, plan.cost(i)):
            at += wait + 1e-6
        heapq.heappush(free, at + latency)
    return at + latency


def held_greedy(plan: Plan, calls: int, processes: int, latency: float, estimate: Callable[[int], int]) -> float:
    """:func:`greedy` in call order, each call counted at ``estimate(i)`` until its reply."""
    free, at, held = [0.0] * processes, 0.0, list[tuple[float, int, int]]()
    for i in range(calls):
        at, guess = max(at, heapq.heappop(free)), estimate(i)
        while True:
            live = [h for h in held if h[0] > at - plan.window]
            used = sum(est if at < t + latency else true for t, est, true in live)
            if len(live) < plan.requests and used + guess <= plan.tokens:
                break
            at = min(x for t, _, _ in live for x in (t + latency, t + plan.window) if x > at) + 1e-6
        held.append((at, guess, plan.cost(i)))
        heapq.heappush(free, at + latency)
    return at + latency


@functools.cache
def fastest_any(plan: Plan, calls: int, processes: int, latency: float, tries: int = 20_000) -> tuple[float, bool]:
    """F: the fastest compliant makespan in any order, and whether it is exact (met the bound)."""
    w = plan.window
    bound = latency + max(w * (math.ceil(plan.total(calls) / plan.tokens) - 1), w * (math.ceil(calls / plan.requests) - 1),
                          latency * (math.ceil(calls / processes) - 1))
    order, rng = list(range(calls)), random.Random(26)
    best = greedy(plan, order, processes, latency)
    for _ in range(tries):
        if best <= bound + 1e-3:
            break
        a, b = rng.randrange(calls), rng.randrange(calls)
        order[a], order[b] = order[b], order[a]
        made = greedy(plan, order, processes, latency)
        if made <= best:
            best = made
        else:
            order[a], order[b] = order[b], order[a]
    return best, best <= bound + 1e-3


def drive(variants: Sequence[Variant], calls: int, plan: Plan | None, timeout: float, api: Api | None = None,
          on_start: Callable[[list[dict[str, Any]]], Callable[[], None]] | None = None,
          say: str = "llm") -> list[dict[str, Any]]:
    """Each client's redis-server and workers, its calls sent at once by its producer, until every
    call got its 200 or ``timeout``: what each got. ``api``: another than the LLM API of ``plan``;
    ``on_start(runs)``, once the workers are up: what to call before they stop."""
    runs, plans = [], {}
    api = api or llm_api(plans)
    with ExitStack() as stack:
        for v in variants:
            print(f"  {say}: {v.name}: a redis-server, 2 workers x {v.concurrency} processes ...", flush=True)
            server, group = stack.enter_context(served(say, one_db=True, concurrency=v.concurrency,
                                                       env={"BENCH_API_URL": api.url}))
            plans[group.prefix] = (plan, v.latency)
            runs.append({"variant": v, "group": group, "label": group.prefix, "server": server, "done_at": 0.0})
        if on_start is not None:
            stack.callback(on_start(runs))
        send = lambda r: produce(r["group"], {"task": r["variant"].task, "args": [r["label"], r["label"]],
                                              "count": calls, "vary": "index",
                                              "ids": True, "pooled": True})[0]
        with ThreadPoolExecutor(len(runs)) as pool:  # every producer at once: the clients share the machine alike
            for run, sent in zip(runs, pool.map(send, runs)):
                run.update(t0=sent["first"], send_s=sent["last"] - sent["first"], ids=sent["ids"])
        deadline, said = time.time() + timeout, time.time()
        while time.time() < deadline and not all(r["done_at"] for r in runs):
            for run in runs:
                if not run["done_at"] and len(api.answered(run["label"])) >= calls:
                    run["done_at"] = time.time()
            if time.time() - said >= 30:
                said = time.time()
                print(f"  {say}: " + ", ".join(f"{len(api.answered(r['label']))}/{calls}" for r in runs), flush=True)
            time.sleep(0.5)
        time.sleep(2.0)  # a late duplicate would show now
        for run in runs:
            arr = run["tally"] = api.tally(run["label"])
            answered = Counter(a.task_id for a in arr if a.answered)
            run["refused"] = sum(a.status == 429 for a in arr)
            run["makespan"] = max((a.answered for a in arr if a.answered), default=math.nan) - run["t0"]
            run["once"] = bool(run["done_at"]) and len(answered) == calls == sum(answered.values()) and \
                set(answered) <= set(run["ids"])
            run["errors"] = run["group"].errors()
    api.close()
    return runs


def run_sweep(res: Results, scale: Any) -> None:
    plan, calls, started, rounds = SWEEP_PLAN, scale.sweep_calls, time.time(), []
    for latency in scale.sweep_latencies:
        best, _ = fastest_any(plan, calls, 8, latency)
        print(f"  llm sweep: calls of {latency:g} s (fastest compliant {best:.1f} s) ...", flush=True)
        rounds.append((latency, drive([dataclasses.replace(v, latency=latency) for v in SWEEP], calls, plan,
                                      3 * best + 120)))
    lines = []
    cells: dict[str, list[str]] = {"sliding": [], "Celery `rate_limit`": []}
    for latency, runs in rounds:
        best, exact = fastest_any(plan, calls, 8, latency)
        in_order = greedy(plan, range(calls), 8, latency)
        held = held_greedy(plan, calls, 8, latency, lambda i: plan.prompt_tokens(i) + MAX_COMPLETION)
        for run in runs:
            v, per100, ratio = run["variant"], run["refused"] * 100 / calls, run["makespan"] / best
            what = f"{v.name}, calls of {latency:g} s"
            res.add(SWEEP_SEC, "429s per 100 calls", what, f"{per100:.1f}", "0", run["refused"] == 0, judged=v.no_429)
            res.add(SWEEP_SEC, "makespan / fastest compliant", what, f"{run['makespan']:.1f} s / {best:.1f} s = "
                    f"{ratio:.3f}", f"<= {SWEEP_TARGET}", ratio <= SWEEP_TARGET,
                    f"{'exact' if exact else 'an upper bound'}; in call order {in_order:.1f} s; the estimate held "
                    f"until the reply allows {held:.1f} s; sends took {run['send_s']:.1f} s", v.no_429)
            res.add(SWEEP_SEC, "every call got exactly one 200", what, yes(run["once"]), "yes", run["once"])
            lines.append(f"| {latency:g} s | {v.name} | {per100:.1f} | {run['makespan']:.1f} s / {best:.0f}"
                         f"{'' if exact else ' (upper bound)'} s = {ratio:.3f} | {run['makespan'] / in_order:.3f} | "
                         f"{held:.0f} s: {run['makespan'] / held:.3f} | {yes(run['once'])} |")
            column = {"prompt_settled": "sliding", "builtin_10s": "Celery `rate_limit`"}.get(v.task)
            if column:
                cells[column].append(f"{per100:.0f}, {ratio:.2f}")
    for column, got in cells.items():
        res.cell("llmsweep", column, " / ".join(got) + f" (L = {', '.join(f'{x:g}' for x, _ in rounds)} s)")
    res.table("llmsweep", f"LLM API of {plan.requests} requests and {plan.tokens:,} tokens per {plan.window:g} s ({calls} "
                          f"calls per client, T = {plan.total(calls):,} tokens, 2 workers x 4 processes, "
                          f"{time.time() - started:.0f} s):\n\n" + md(
                              "| L | client | 429s per 100 calls | makespan / fastest compliant | / fastest in call "
                              "order | / fastest with prompt + 200 held until the reply | each call once |", lines))


# -- 46: the API's own count, read from its replies' headers ---------------------------------
OBSERVE_SEC, OBSERVE_LATENCY, OBSERVE_TARGET = "46 the API's headers", 3.0, 1.10
#: Clients of the same API (L = 3 s): a call estimated at its prompt and a reply's mean, settled
#: with what it used, with and without the reply's headers; the worst case estimated (prompt + the
#: most a reply uses), the one that drew no 429 before.
OBSERVE = (Variant('cost={"tokens": prompt + 100}, charge(tokens=n), observe(reply)', "mean_observed",
                   no_429=True, concurrency=4, latency=OBSERVE_LATENCY),
           Variant('cost={"tokens": prompt + 100}, charge(tokens=n)', "mean_settled", concurrency=4,
                   latency=OBSERVE_LATENCY),
           Variant('cost={"tokens": prompt + 200}, charge(tokens=n)', "prompt_settled", concurrency=4,
                   latency=OBSERVE_LATENCY))


def run_observe(res: Results, scale: Any) -> None:
    plan, calls, started = SWEEP_PLAN, scale.sweep_calls, time.time()
    best, exact = fastest_any(plan, calls, 8, OBSERVE_LATENCY)
    lines = []
    for variant in OBSERVE:  # (one at a time: 2 cores)
        print(f"  observe: {variant.name} (fastest compliant {best:.1f} s) ...", flush=True)
        run = drive([variant], calls, plan, 3 * best + 120, say="observe")[0]
        per100, ratio = run["refused"] * 100 / calls, run["makespan"] / best
        res.add(OBSERVE_SEC, "429s per 100 calls", variant.name, f"{per100:.1f}", "0", run["refused"] == 0,
                judged=variant.no_429)
        res.add(OBSERVE_SEC, "makespan / fastest compliant", variant.name, f"{run['makespan']:.1f} s / {best:.1f} s = "
                f"{ratio:.3f}", f"<= {OBSERVE_TARGET}", ratio <= OBSERVE_TARGET,
                "exact" if exact else "an upper bound", variant.no_429)
        res.add(OBSERVE_SEC, "every call got exactly one 200", variant.name, yes(run["once"]), "yes", run["once"])
        res.errors(f"observe, {variant.name}", run["errors"])
        lines.append(f"| {variant.name} | {per100:.1f} | {run['makespan']:.1f} s / {best:.0f} s = {ratio:.3f} | "
                     f"{yes(run['once'])} |")
    res.table("observe", f"LLM API of {plan.requests} requests and {plan.tokens:,} tokens per {plan.window:g} s, counting "
                         f"each call's real tokens at arrival and saying what is left on every reply "
                         f"(x-ratelimit-remaining-requests/-tokens); calls of {OBSERVE_LATENCY:g} s, {calls} per client, "
                         f"2 workers x 4 processes, one client at a time ({time.time() - started:.0f} s)\n\n" + md(
                             "| client | 429s per 100 calls | makespan / fastest compliant | each call once |", lines))
