"""Section 46b (shapes, issue 46 item 3): adaptive limits on APIs whose limits move in shapes
they were not tuned on.

Each shape is an API enforcing at most ``limit(t)`` accepted calls in any 1 s per account (t: s
from the account's first call), unknown to the client, which declares ``100/s``; a refusal is a
429 or a 503, with ``Retry-After: 1`` or none. A 200 takes :data:`LATENCY` s. Clients, one at a
time, each on a redis-server and 2 workers x 4 prefork of its own, all calls sent at once by a
producer that only imports the tasks module:

- ``adapt=True``, the body raising ``Backoff(retry_after=reply.headers.get("Retry-After"))``;
- ``Backoff`` alone at ``100/s`` (the same body);
- the oracle: ``@throttle("50/s")`` told each limit as it changes (bench/api429.py's ``oracle``);
- Celery's ``rate_limit="50/s"`` per worker retrying after Retry-After (1 s when none), on the
  first shape only (it is far behind on every shape: section adapt).

Reported per shape and client: 429s (or 503s) per 100 calls accepted, makespan against the
oracle's and against the fastest possible (the limit integrated over time), each call once.
Targets (issue 46): ``adapt=True`` at most 2 refusals per 100 and 1.10 of the oracle's makespan.

``python -m bench.shapes --timeline N [--calls C]``: shape N (0 to 4, in the order above) and the
adaptive client alone, second by second (the API's limit, the calls it took and refused), then each
write of the key's last pushback as the store held it (its level and the refused share of its window):
where the makespan goes.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from bench.api429 import ADAPT_CLIENTS, oracle
from bench.common import Api, Results, md, yes
from bench.llm import Variant, drive

SEC, MOST_REFUSED, MOST_SPAN = "46b adaptive shapes", 2.0, 1.10
#: Seconds a 200 takes (the issue's calls of ~0.1 s).
LATENCY = 0.1


def steps(t: float) -> float:
    """The issue's shape: 30/s for 15 s, 12/s for 15 s, then 45/s."""
    return 30 if t < 15 else 12 if t < 30 else 45


def drift(t: float) -> float:
    """A slow drift: 40/s sliding to 12/s over 20 s, then up to 45/s over 20 s, then 45/s."""
    if t < 20:
        return 40 - 28 * t / 20
    return 12 + 33 * min(t - 20, 20) / 20


def shared(t: float) -> float:
    """A limit of 40/s shared with another client of the same account that takes nothing for 10 s,
    then 28/s for 15 s, then 5/s: what is left for the client under test."""
    return 40 - (0 if t < 10 else 28 if t < 25 else 5)


@dataclass(frozen=True)
class Shape:
    name: str
    limit: Callable[[float], float]
    status: int = 429
    #: Retry-After's seconds, or None: the refusal says nothing.
    retry_after: float | None = 1.0
    #: Celery's rate_limit beside the others (on one shape: it takes long).
    builtin: bool = False

    @property
    def refusal(self) -> str:
        return f"{self.status}" + (f" with Retry-After: {self.retry_after:g}" if self.retry_after is not None
                                   else " without Retry-After")


SHAPES = (Shape("steps 30 → 12 → 45/s", steps, builtin=True),
          Shape("steps 30 → 12 → 45/s", steps, retry_after=None),
          Shape("drift 40 ↘ 12 ↗ 45/s", drift, status=503, retry_after=None),
          Shape("shared 40/s, the other client takes 0, 28, 5/s", shared),
          Shape("shared 40/s, the other client takes 0, 28, 5/s", shared, status=503, retry_after=None))


def shape_api(shape: Shape) -> tuple[Api, dict[str, float]]:
    """The API, and each account's first call."""
    firsts: dict[str, float] = {}
    taken: dict[str, deque[float]] = {}
    lock = threading.Lock()

    def decide(path: str, q: dict[str, str]) -> tuple[Any, ...]:
        with lock:
            now = time.time()
            first, window = firsts.setdefault(q["account"], now), taken.setdefault(q["account"], deque())
            while window and window[0] <= now - 1.0:
                window.popleft()
            if len(window) < math.floor(shape.limit(now - first)):
                window.append(now)
                return 200, 0, 0.0, LATENCY
        return shape.status, 0, shape.retry_after, 0.0

    return Api(decide), firsts


def fastest(limit: Callable[[float], float], calls: int, step: float = 0.01) -> float:
    """Seconds from the first call until the API could have taken ``calls``: its limit integrated over
    time (a sliding window lets a second's calls in at once: a client could end up to 1 s sooner)."""
    t, taken = 0.0, 0.0
    while taken < calls:
        taken += math.floor(limit(t)) * step
        t += step
    return t


def clients(shape: Shape) -> list[str]:
    return ["adapt_learning", "adapt_backoff", "adapt_oracle"] + (["adapt_builtin"] if shape.builtin else [])


def figures(run: dict[str, Any], status: int) -> tuple[float, float, bool]:
    """Refusals per 100 calls accepted, makespan (to its last 200 so far), done."""
    accepted = sum(a.status == 200 and bool(a.answered) for a in run["tally"])
    refused = sum(a.status == status for a in run["tally"])
    return refused * 100 / max(accepted, 1), run["makespan"], bool(run["done_at"])


def run_shapes(res: Results, scale: Any) -> None:
    calls, started, lines = scale.shape_calls, time.time(), []
    for shape in SHAPES:
        best = fastest(shape.limit, calls)
        print(f"  shapes: {shape.name}, {shape.refusal}: {calls} calls per client (fastest possible "
              f"{best:.1f} s) ...", flush=True)
        runs = []
        for task in clients(shape):  # (one at a time: 2 cores)
            api, firsts = shape_api(shape)
            runs += drive([Variant(ADAPT_CLIENTS[task], task, concurrency=4)], calls, None, 2 * best + 60, api=api,
                          on_start=oracle(shape.limit, firsts), say="shapes")
        lines += report(res, shape, runs, calls, best)
    res.table("shapes", (
        f"APIs whose limit per account moves in shapes the law was not tuned on, unknown to the client (declared "
        f"100/s); calls of {LATENCY:g} s, {calls} per client sent at once, 2 workers x 4 prefork, one client at a "
        f"time ({time.time() - started:.0f} s). Fastest possible: the limit integrated over time. The oracle is "
        "told each limit as it changes.\n\n") + md(
        "| shape | refusal | client | refusals per 100 calls accepted | makespan / the oracle's | / fastest possible "
        "| each call once |", lines))


def report(res: Results, shape: Shape, runs: list[dict[str, Any]], calls: int, best: float) -> list[str]:
    by = {r["variant"].task: r for r in runs}
    _, ospan, odone = figures(by["adapt_oracle"], shape.status)
    lines = []
    for run in runs:
        v = run["variant"]
        per100, span, done = figures(run, shape.status)
        more, judged = "" if done else "> ", v.task == "adapt_learning"
        variant = f"{v.name} | {shape.name}, {shape.refusal}"
        res.add(SEC, "refusals per 100 calls", variant, f"{per100:.1f}", f"<= {MOST_REFUSED:g}",
                per100 <= MOST_REFUSED, f"{len(run['tally'])} requests for {calls} calls", judged)
        res.add(SEC, "makespan / the oracle's", variant, f"{more}{span:.1f} s / {ospan:.1f} s = {more}{span / ospan:.3f}",
                f"<= {MOST_SPAN:g}", done and odone and span / ospan <= MOST_SPAN,
                f"/ fastest possible ({best:.1f} s): {more}{span / best:.3f}" + ("" if done else "; not done in time"),
                judged)
        res.add(SEC, "every call got exactly one 200", variant, yes(run["once"]), "yes", run["once"])
        res.errors(f"shapes, {variant}", run["errors"])
        if run["set_at"]:
            res.notes.append(f"shapes, {variant}: limits set at {run['set_at'][:40]} (s after the first call)")
        lines.append(f"| {shape.name} | {shape.refusal} | {v.name} | {per100:.1f} | {more}{span / ospan:.3f} | "
                     f"{more}{span / best:.3f} | {yes(run['once'])} |")
    return lines


def pushbacks(seen: list[tuple[float, str, str]]) -> Callable[[list[dict[str, Any]]], Callable[[], None]]:
    """``drive``'s ``on_start``: each new value of the adaptive key's last pushback (field 'A' of its
    state hash, and 'Ar', the refused share of its window), when it was read, into ``seen``."""
    def on_start(runs: list[dict[str, Any]]) -> Callable[[], None]:
        stop, run = threading.Event(), runs[0]

        def follow() -> None:
            client, key, last = redis.Redis.from_url(run["server"].url, decode_responses=True), None, None
            while not stop.wait(PUSHBACK_READ_S):
                if key is None:  # (the state hash appears with the first check)
                    key = next((k for k in client.scan_iter(match=f"{run['group'].prefix}*", count=1000)
                                if client.type(k) == "hash" and client.hexists(k, "A")), None)
                    continue
                pushed = client.hmget(key, "A", "Ar")
                if pushed[0] != last:
                    last = pushed[0]
                    seen.append((time.time(), pushed[0] or "-", pushed[1] or "-"))
            client.close()

        def stopped() -> None:
            stop.set()
            thread.join(5)

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        return stopped
    return on_start


#: How often the timeline reads the key's last pushback (s).
PUSHBACK_READ_S = 0.02


def timeline(index: int, calls: int) -> None:
    shape, seen = SHAPES[index], list[tuple[float, str, str]]()
    best = fastest(shape.limit, calls)
    api, firsts = shape_api(shape)
    run = drive([Variant(ADAPT_CLIENTS["adapt_learning"], "adapt_learning", concurrency=4)], calls, None,
                2 * best + 60, api=api, on_start=pushbacks(seen), say="timeline")[0]
    first = min(firsts.values())
    took: dict[int, int] = {}
    refused: dict[int, int] = {}
    for a in run["tally"]:
        second = int(a.at - first)
        if a.status == 200:
            took[second] = took.get(second, 0) + 1
        else:
            refused[second] = refused.get(second, 0) + 1
    per100, span, _ = figures(run, shape.status)
    print(f"{shape.name}, {shape.refusal}: {per100:.1f} refusals per 100 calls, makespan {span:.1f} s / fastest "
          f"possible {best:.1f} s = {span / best:.3f}\n\n| s | limit | took | refused |\n|---|---|---|---|")
    for second in range(max(took, default=0) + 1):
        print(f"| {second} | {math.floor(shape.limit(second + 0.5))} | {took.get(second, 0)} | "
              f"{refused.get(second, 0)} |")
    print("\n| s | last pushback (level, at, why) | refused share of its window |\n|---|---|---|")
    for at, pushed, share in seen:
        print(f"| {at - first:.2f} | {pushed} | {share} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shapes", description=__doc__.splitlines()[0])
    p.add_argument("--timeline", type=int, required=True, choices=range(len(SHAPES)), metavar="N",
                   help=f"the shape (0 to {len(SHAPES) - 1}): its adaptive client alone, second by second")
    p.add_argument("--calls", type=int, default=1_500, help="calls sent at once")
    args = p.parse_args(argv)
    timeline(args.timeline, args.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
