"""Section 15: an LLM-style API, whose limits count requests and tokens (issue #18).

The API (bench/llmapi.py, in a thread of this process) allows each account 60 requests
and 10 000 tokens in any 60 s, a call's tokens drawn by the API at random (uniform
50..450, mean 250: tokens bind first, at about 40 calls a minute) and known to the client
only from the reply; 429 with ``Retry-After`` otherwise. The draw depends on the call's
index alone, so every variant faces the same calls, and T, the tokens of the N calls, is
known in advance.

Clients (bench/llmworker.py): ``@throttle("60/m", "10000 tokens/m")`` estimating each call
at the mean (250) or at the most (450), not settled; estimating the most, or the mean,
and settling with ``charge(tokens=n)`` once the API reported n; Celery's ``rate_limit="30/m"`` per
worker (two workers: 60/m). Each retries a 429 with ``self.retry(countdown=Retry-After)``.

The variants run at the same time, each on a redis-server of its own (broker and throttle
store), with its own account and 2 workers x 2 prefork processes; a producer process per
variant (bench/llm_producer.py, as users write one: its sends are checked at publish)
sends the N calls at once. Reported per variant: 429s per 100 calls (counted by the API),
makespan (first send to last 200) against the ideal 60 s x max(N / 60, T / 10 000), the
most requests and tokens the API accepted (and was offered) in any 60 s, and whether every
call got exactly one 200.

Section 15b (issue 26, :func:`run_sweep`): the API at 20 requests and 4 000 tokens per
sliding 10 s (bench.llmapi.PLAN26: a call's prompt of 50..250 tokens, known to the client,
and a completion of 20..200, known from the reply), answering L seconds after a call
arrives, L = 0, 1, 2, 3 s in turn. Three clients side by side in each round, 120 calls each
sent at once by a producer process, on 2 workers x 4 prefork processes of their own:
``@throttle`` estimating the prompt + 200 (the most a call uses: docs/design.md's advice)
settled by ``charge()``; Celery's ``rate_limit="1/s"`` per worker; a by-hand check with
``limits`` (bench/llmworker.py says how each is written).

The denominator of 15b's ratios, the fastest compliant makespan F(L) (first send to last
200), from the calls' true tokens c_i, the limits (R = 20 requests, K = 4 000 tokens in any
W = 10 s, counted at arrival), P = 8 processes (a call holds one from its arrival to its
reply, L s later) and L:

* A lower bound. Arrivals from the first send (0) to the last (a) lie in floor(a / W) + 1
  half-open windows ``[kW, (k + 1)W)``, each holding at most K tokens and R requests (the
  API counts ``(t - W, t]``), so a >= W x (ceil(T / K) - 1) for T = sum c_i, and
  a >= W x (ceil(N / R) - 1); P processes take N calls in ceil(N / P) rounds of L.
  F >= the largest of these + L.
* A schedule. :func:`greedy` sends calls in a given order, each at the earliest moment a
  process is free and the API's window (bench.llmapi.Window, the API's own rule) admits
  it. In call order this is the fastest any first-come-first-served client can do (by
  induction: each greedy arrival is no later than the same call's in any compliant
  in-call-order schedule, which therefore sees no less in any window). :func:`fastest_any`
  then swaps calls in the order (a seeded local search, kept when no slower) until the
  schedule meets the lower bound: F is then exact. If it never does (within its budget),
  the best schedule found is the denominator, an upper bound on F, and the report says so.

For this draw (T = 29 411 tokens) F = 70 + L s: the lower bound, met by a reordered
schedule. In call order the best is 70 + 2L: with 8 calls in flight the last window's 11
calls arrive in two rounds, L apart. Both are reported; the ratios are of F.

A third figure, what the estimate allows (:func:`held_greedy`): the same greedy in call
order, but each call counted at its estimate (prompt + 200) from its arrival until its
reply L s later, then at its true tokens, as a client that learns a call's cost from the
reply and never risks a 429 must count it. Earlier starts only bring refunds and expiries
earlier, so this greedy is the fastest such a client can be in call order: at L = 0 it is
F; as calls lengthen, a window's room comes back in steps of L, as its calls report.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
import math
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

from bench.backlog import dedicated_redis
from bench.common import OUT_DIR, ROOT, Results, max_in_window
from bench.llmapi import MAX_COMPLETION, PLAN15, PLAN26, Arrival, LlmApi, Plan, Tally, Window
from bench.redis_per_task import redis_binary
from bench.workers import WorkerGroup

SEC = "15 llm"
SWEEP_SEC = "15b llm sweep"
APP = "bench.llmworker"
REQUESTS, TOKENS, WINDOW_S = PLAN15.requests, PLAN15.tokens, PLAN15.window
(LOW, HIGH) = PLAN15.completion


@dataclass(frozen=True)
class Variant:
    name: str
    task: str  # in bench.llmworker
    #: Its calls must draw no 429 (a target of 0).
    no_429: bool = False
    #: Seconds between two sends (0: all at once).
    pace: float = 0.0
    #: Seconds the API takes to answer a call it accepts.
    latency: float = 0.0
    #: ``throttle_start_grace`` of its workers and producer (seconds; None: the default).
    start_grace: float | None = None
    #: Prefork processes of each of its 2 workers.
    concurrency: int = 2

    @property
    def slug(self) -> str:
        return self.task + (f"-paced{self.pace:g}" if self.pace else "") + (
            f"-slow{self.latency:g}" if self.latency else "") + (
            f"-grace{self.start_grace:g}" if self.start_grace is not None else "")


VARIANTS = (
    Variant('cost={"tokens": 250} (the mean), not settled', "estimate"),
    Variant('cost={"tokens": 450} (the most), not settled', "estimate_max", no_429=True),
    Variant('cost={"tokens": 450}, charge(tokens=n)', "settled", no_429=True),
    # What a user would most likely write: the mean, settled (0 on a 429, as above).
    Variant('cost={"tokens": 250} (the mean), charge(tokens=n)', "estimate_settled"),
    Variant('Celery rate_limit="30/m" per worker', "builtin"),
    # A burst sent at once is reserved on its estimates (settling moves no start already
    # reserved): the same two clients, their calls sent one a second, show what settling
    # gives back to calls checked after the reports.
    Variant('cost={"tokens": 450} (the most), not settled, sent 1/s', "estimate_max", no_429=True, pace=1.0),
    Variant('cost={"tokens": 450}, charge(tokens=n), sent 1/s', "settled", no_429=True, pace=1.0),
    # A model takes time to answer: a body that outlasts its share of the pool misses the
    # start reserved for it.
    Variant('cost={"tokens": 450}, charge(tokens=n), API answers in 0.5 s', "settled", no_429=True,
            latency=0.5),
    # The same with a grace a window's worth of such calls can start in on 4 processes
    # (throttle_start_grace), and what that grace costs calls that answer at once.
    Variant('cost={"tokens": 450}, charge(tokens=n), API answers in 0.5 s, start grace 4 s', "settled",
            no_429=True, latency=0.5, start_grace=4.0),
    Variant('cost={"tokens": 450}, charge(tokens=n), start grace 4 s', "settled", no_429=True, start_grace=4.0),
)


#: Section 15b's clients (each run at every latency of the sweep).
SWEEP = (
    Variant('@throttle("20/10s", "4000 tokens/10s", cost={"tokens": prompt + 200}), charge(tokens=n)',
            "prompt_settled", no_429=True, concurrency=4),
    Variant('Celery rate_limit="1/s" per worker', "builtin_10s", concurrency=4),
    Variant("by hand: limits moving window, requests and prompt + 200 tokens", "by_hand", concurrency=4),
)
SWEEP_TARGET = 1.05


@dataclass
class Run:
    variant: Variant
    calls: int
    label: str
    group: WorkerGroup
    producer: subprocess.Popen[bytes] | None = None
    t0: float = float("nan")
    send_s: float = float("nan")
    ids: list[str] = field(default_factory=list)
    done_at: float = 0.0
    tally: Tally = field(default_factory=Tally)
    errors: list[str] = field(default_factory=list)

    @property
    def answered(self) -> list[Arrival]:
        return [a for a in self.tally.arrivals if a.answered]

    @property
    def makespan(self) -> float:
        return max((a.answered for a in self.answered), default=float("nan")) - self.t0

    @property
    def once(self) -> tuple[int, int, int]:
        """(distinct calls that got their 200, duplicate 200s, 200s of ids not sent)."""
        seen = Counter(a.task_id for a in self.answered)
        return len(seen), sum(seen.values()) - len(seen), len(set(seen) - set(self.ids))

    @property
    def exactly_once(self) -> bool:
        unique, dup, foreign = self.once
        return bool(self.done_at) and unique == self.calls and dup == 0 and foreign == 0


def ideal(calls: int) -> float:
    """60 s x max(N / 60, T / 10 000): the API's limits as steady rates."""
    return WINDOW_S * max(calls / REQUESTS, PLAN15.total(calls) / TOKENS)


def greedy(plan: Plan, order: Sequence[int], processes: int = 0, latency: float = 0.0) -> float:
    """The makespan of a client that knew every call's tokens and sent each, in ``order``,
    the moment one of ``processes`` (0: no bound) was free and the API's window had room;
    a call holds its process ``latency`` s and ends then (a fresh account takes a whole
    window's worth at once, so in section 15 this is below :func:`ideal`)."""
    window, at, free = Window(plan), 0.0, [0.0] * processes
    for i in order:
        if free:
            at = max(at, heapq.heappop(free))
        while wait := window.admit(at, plan.cost(i)):
            at += wait + 1e-6
        if processes:
            heapq.heappush(free, at + latency)
    return at + latency


def held_greedy(plan: Plan, calls: int, processes: int, latency: float, estimate: Callable[[int], int]) -> float:
    """:func:`greedy` in call order, each call counted at ``estimate(i)`` from its arrival
    until its reply (``latency`` s later), at its true tokens after (the module's docstring)."""
    w, free, at = plan.window, [0.0] * processes, 0.0
    held: list[tuple[float, int, int]] = []  # (arrival, estimate, tokens)
    for i in range(calls):
        at, guess = max(at, heapq.heappop(free)), estimate(i)
        while True:
            live = [h for h in held if h[0] > at - w]
            used = sum(est if at < t + latency else true for t, est, true in live)
            if len(live) < plan.requests and used + guess <= plan.tokens:
                break
            at = min(x for t, _, _ in live for x in (t + latency, t + w) if x > at) + 1e-6
        held.append((at, guess, plan.cost(i)))
        heapq.heappush(free, at + latency)
    return at + latency


def fastest(calls: int) -> float:
    """Section 15's fastest makespan: its calls in order, no bound on processes."""
    return greedy(PLAN15, range(calls))


def lower_bound(plan: Plan, calls: int, processes: int, latency: float) -> float:
    """No compliant schedule ends sooner (the module's docstring)."""
    w = plan.window
    return latency + max(w * (math.ceil(plan.total(calls) / plan.tokens) - 1),
                         w * (math.ceil(calls / plan.requests) - 1), latency * (math.ceil(calls / processes) - 1))


@functools.cache
def fastest_any(plan: Plan, calls: int, processes: int, latency: float, tries: int = 20_000) -> tuple[float, bool]:
    """The fastest compliant makespan in any order, and whether it is exact (it met the
    lower bound); else the best schedule found, an upper bound."""
    bound, order = lower_bound(plan, calls, processes, latency), list(range(calls))
    best, rng = greedy(plan, order, processes, latency), random.Random(26)
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


def most_tokens(arrivals: Sequence[Arrival], window: float = WINDOW_S) -> int:
    """Most tokens of ``arrivals`` in any half-open ``[t, t + window)``."""
    ordered = sorted(arrivals, key=lambda a: a.at)
    best = held = lo = 0
    for a in ordered:
        held += a.tokens
        while ordered[lo].at <= a.at - window:
            held -= ordered[lo].tokens
            lo += 1
        best = max(best, held)
    return best


def _start(stack: ExitStack, prefix: str, api_url: str, variant: Variant, calls: int) -> Run:
    server = stack.enter_context(dedicated_redis(f"llm-{variant.slug}", redis_binary()))
    run = f"{prefix}-llm-{variant.slug}"
    env = {"CB_BROKER": server.url, "CB_PREFIX": run, "CB_QUEUE": f"{run}-q", "CB_API_URL": api_url}
    if variant.start_grace is not None:
        env["CB_START_GRACE"] = str(variant.start_grace)
    group = WorkerGroup(run, f"llm-{variant.slug}", count=2, concurrency=variant.concurrency, env=env, app=APP)
    group.queue = env["CB_QUEUE"]
    stack.callback(group.stop)  # (before start: a group that fails to start is stopped too)
    group.start()
    return Run(variant, calls, label=run, group=group)


def _send(run: Run, account: str) -> None:
    log = OUT_DIR / "logs" / f"llm-producer-{run.variant.slug}.log"
    with open(log, "wb") as err:
        run.producer = subprocess.Popen(
            [sys.executable, "-m", "bench.llm_producer", run.variant.task, run.label, account, str(run.calls),
             str(run.variant.pace)],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **run.group.env), stdout=subprocess.PIPE,
            stderr=err)


def _sent(run: Run) -> None:
    assert run.producer is not None
    out, _ = run.producer.communicate(timeout=run.calls * run.variant.pace + 120)
    if run.producer.returncode:
        raise RuntimeError(f"the producer of {run.variant.name} failed: see bench/out/logs")
    sent = json.loads(out.decode().strip().splitlines()[-1])
    run.t0, run.send_s, run.ids = sent["t0"], sent["send_s"], sent["ids"]


def run_llm(res: Results, prefix: str, calls: int, variants: Sequence[Variant] = VARIANTS) -> None:
    started = time.time()
    with LlmApi() as api:
        runs = _drive(api, prefix, variants, calls, PLAN15, 3 * ideal(calls) + 120)
    _report(res, runs, calls, time.time() - started)


def _drive(api: LlmApi, prefix: str, variants: Sequence[Variant], calls: int, plan: Plan,
           timeout: float) -> list[Run]:
    """Start each variant's server and workers, send its calls, wait for every 200."""
    started = time.time()
    runs: list[Run] = []
    with ExitStack() as stack:
        for variant in variants:
            print(f"  llm: starting {variant.name}: a redis-server, 2 workers x {variant.concurrency} processes ...",
                  flush=True)
            runs.append(_start(stack, prefix, api.url, variant, calls))
            api.latency[runs[-1].label] = variant.latency
            api.plans[runs[-1].label] = plan
        for run in runs:  # every producer at once: the variants share the machine alike
            _send(run, account=run.label)
        for run in runs:
            _sent(run)
        print(f"  llm: {calls} calls sent by each of {len(runs)} producers; waiting up to {timeout:.0f} s ...",
              flush=True)
        deadline, said = time.time() + timeout, time.time()
        while time.time() < deadline and not all(r.done_at for r in runs):
            for run in runs:
                if not run.done_at and len(api.answered(run.label)) >= calls:
                    run.done_at = time.time()
            if time.time() - said >= 30:
                said = time.time()
                print(f"  llm [{said - started:.0f}s]: " + ", ".join(
                    f"{r.variant.slug} {len(api.answered(r.label))}/{calls}" for r in runs), flush=True)
            time.sleep(0.5)
        time.sleep(2.0)  # a late duplicate would show now
        for run in runs:
            run.tally = api.tally(run.label)
            run.errors = run.group.errors()
    return runs


def _report(res: Results, runs: Sequence[Run], calls: int, elapsed: float) -> None:
    best, fast = ideal(calls), fastest(calls)
    total = PLAN15.total(calls)
    lines = [(f"LLM API ({calls} calls per variant, sent at once unless paced, T = {total:,} tokens, ideal {best:.0f} s, "
              f"{elapsed:.0f} s):\n"),
             ("| client | 429s per 100 calls | makespan / ideal | most accepted in any 60 s: requests / tokens "
              "| offered in any 60 s (429s included) | each call once |"),
             "|---|---|---|---|---|---|"]
    for run in runs:
        v, tally = run.variant, run.tally
        least = max(fast, (calls - 1) * v.pace)  # (a paced producer sends its last call that late)
        per100 = tally.refused * 100 / calls
        accepted = tally.accepted()
        most = (max_in_window([a.at for a in accepted], WINDOW_S), most_tokens(accepted))
        offered = (max_in_window([a.at for a in tally.arrivals], WINDOW_S), most_tokens(tally.arrivals))
        unique, dup, foreign = run.once
        res.add(SEC, "429s per 100 calls", v.name, f"{per100:.1f}", "0" if v.no_429 else "",
                tally.refused == 0 if v.no_429 else None,
                f"{tally.requests} requests for {calls} calls")
        res.add(SEC, "makespan / ideal", v.name, f"{run.makespan:.0f} s / {best:.0f} s = {run.makespan / best:.2f}",
                note=f"fastest possible {least:.0f} s ({least / best:.2f} of the ideal): a fresh account takes "
                     f"a window's tokens at once; sends took {run.send_s:.1f} s")
        res.add(SEC, "most accepted in any 60 s: requests / tokens", v.name, f"{most[0]} / {most[1]:,}",
                f"<= {REQUESTS} / {TOKENS:,}", most[0] <= REQUESTS and most[1] <= TOKENS,
                f"offered (429s included): {offered[0]} / {offered[1]:,}")
        res.add(SEC, "every call got exactly one 200", v.name, f"{unique}/{calls}, {dup} dup, {foreign} foreign",
                "all, 0 dup", run.exactly_once,
                "" if run.done_at else f"not all answered in {run.makespan:.0f} s")
        once = "yes" if run.exactly_once else "NO"
        lines.append(f"| {v.name} | {per100:.1f} | {run.makespan:.0f} s = {run.makespan / best:.2f} "
                     f"| {most[0]} / {most[1]:,} | {offered[0]} / {offered[1]:,} | {once} |")
    res.tables.append("\n".join(lines))
    # Every arrival, for a look at how each client spread its calls (bench/out/results.json).
    res.series["llm"] = {r.variant.name: [(round(a.at - r.t0, 3), a.status, a.tokens) for a in r.tally.arrivals]
                         for r in runs}
    errors = sorted({e for r in runs for e in r.errors})
    if errors:
        res.notes.append(f"LLM API: worker log errors ({len(errors)}): " + " | ".join(errors[:5]))
    res.notes.append(
        f"LLM API: {REQUESTS} requests and {TOKENS:,} tokens per account in any {WINDOW_S:.0f} s, a call's tokens "
        f"drawn uniform {LOW}..{HIGH} by the API from its index (the same for every variant), counted at arrival "
        "(the 200 sent at once unless a latency is named); a 429 counts toward neither limit and carries Retry-After (whole "
        "seconds until the call fits). Tasks retry a 429 with self.retry(countdown=Retry-After). Variants run at "
        "the same time, each with a redis-server, an account, a producer process and 2 workers x 2 prefork "
        "processes of its own. Celery's rate_limit is per worker: 30/m on each of 2 workers. Ideal: 60 s x "
        f"max(N / {REQUESTS}, T / {TOKENS:,}).")


def run_sweep(res: Results, prefix: str, calls: int, latencies: Sequence[float] = (0.0, 1.0, 2.0, 3.0)) -> None:
    """Section 15b: the clients of :data:`SWEEP` side by side, one round per latency."""
    started, rounds = time.time(), []
    with LlmApi() as api:
        for latency in latencies:
            best, _ = fastest_any(PLAN26, calls, 8, latency)
            print(f"  llm sweep: calls of {latency:g} s (fastest compliant {best:.1f} s) ...", flush=True)
            variants = [dataclasses.replace(v, latency=latency) for v in SWEEP]
            rounds.append((latency, _drive(api, prefix, variants, calls, PLAN26, 3 * best + 120)))
    _report_sweep(res, rounds, calls, time.time() - started)


def _report_sweep(res: Results, rounds: Sequence[tuple[float, Sequence[Run]]], calls: int, elapsed: float) -> None:
    plan = PLAN26
    lines = [(f"LLM API of {plan.requests} requests and {plan.tokens:,} tokens per {plan.window:g} s ({calls} calls "
              f"per client sent at once, T = {plan.total(calls):,} tokens, 2 workers x 4 processes, {elapsed:.0f} s):\n"),
             ("| L | client | 429s per 100 calls | makespan / fastest compliant | / fastest in call order "
              "| / fastest with prompt + 200 held until the reply | each call once |"),
             "|---|---|---|---|---|---|---|"]
    for latency, runs in rounds:
        best, exact = fastest_any(plan, calls, 8, latency)
        in_order = greedy(plan, range(calls), 8, latency)
        held = held_greedy(plan, calls, 8, latency, lambda i: plan.prompt_tokens(i) + MAX_COMPLETION)
        for run in runs:
            v, tally = run.variant, run.tally
            per100, ratio = tally.refused * 100 / calls, run.makespan / best
            what = f"{v.name}, calls of {latency:g} s"
            res.add(SWEEP_SEC, "429s per 100 calls", what, f"{per100:.1f}", "0" if v.no_429 else "",
                    tally.refused == 0 if v.no_429 else None, f"{tally.requests} requests for {calls} calls")
            res.add(SWEEP_SEC, "makespan / fastest compliant", what,
                    f"{run.makespan:.1f} s / {best:.1f} s = {ratio:.3f}", f"<= {SWEEP_TARGET}" if v.no_429 else "",
                    ratio <= SWEEP_TARGET if v.no_429 else None,
                    f"{'exact' if exact else 'an upper bound'}; in call order {in_order:.1f} s; the estimate "
                    f"held until the reply allows {held:.1f} s; sends took {run.send_s:.1f} s")
            res.add(SWEEP_SEC, "every call got exactly one 200", what, "yes" if run.exactly_once else "NO",
                    "yes", run.exactly_once, "" if run.done_at else f"not all answered in {run.makespan:.0f} s")
            lines.append(f"| {latency:g} s | {v.name} | {per100:.1f} | {run.makespan:.1f} s / "
                         f"{best:.0f}{'' if exact else ' (upper bound)'} s = {ratio:.3f} | {run.makespan / in_order:.3f} "
                         f"| {held:.0f} s: {run.makespan / held:.3f} | {'yes' if run.exactly_once else 'NO'} |")
    res.tables.append("\n".join(lines))
    res.series["llm sweep"] = {f"{r.variant.name}, L={lat:g}": [
        (round(a.at - r.t0, 3), a.status, a.tokens, round(a.answered - r.t0, 3) if a.answered else None,
         r.ids.index(a.task_id) if a.task_id in r.ids else -1) for a in r.tally.arrivals]
        for lat, runs in rounds for r in runs}
    errors = sorted({e for _, runs in rounds for r in runs for e in r.errors})
    if errors:
        res.notes.append(f"LLM sweep: worker log errors ({len(errors)}): " + " | ".join(errors[:5]))
    res.notes.append(
        f"LLM sweep: {plan.requests} requests and {plan.tokens:,} tokens per account in any {plan.window:g} s, counted "
        f"at arrival; a call's tokens are its prompt's ({plan.prompt[0]}..{plan.prompt[1]}) and its completion's "
        f"({plan.completion[0]}..{plan.completion[1]}), drawn from its index; the 200 is sent L s after the arrival. "
        "Each round's three clients ran side by side, each with a redis-server, an account, a producer process and "
        "2 workers x 4 prefork processes of its own. Fastest compliant: the module docstring of bench/llm.py.")
