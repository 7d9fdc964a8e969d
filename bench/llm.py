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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

from bench.backlog import dedicated_redis
from bench.common import OUT_DIR, ROOT, Results, max_in_window
from bench.llmapi import (
    HIGH,
    LOW,
    REQUESTS,
    TOKENS,
    WINDOW_S,
    Arrival,
    LlmApi,
    Tally,
    Window,
    tokens,
)
from bench.redis_per_task import redis_binary
from bench.workers import WorkerGroup

SEC = "15 llm"
APP = "bench.llmworker"


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
    total = sum(tokens(i) for i in range(calls))
    return WINDOW_S * max(calls / REQUESTS, total / TOKENS)


def fastest(calls: int) -> float:
    """The makespan of a client that knew every call's tokens and sent each, in order, the
    moment the API's window had room (a fresh account takes a whole window's worth at once,
    so this is below :func:`ideal`)."""
    window, at = Window(), 0.0
    for i in range(calls):
        while wait := window.admit(at, tokens(i)):
            at += wait + 1e-6
    return at


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
    group = WorkerGroup(run, f"llm-{variant.slug}", count=2, concurrency=2, env=env, app=APP)
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
    runs: list[Run] = []
    timeout = 3 * ideal(calls) + 120
    with LlmApi() as api, ExitStack() as stack:
        for variant in variants:
            print(f"  llm: starting {variant.name}: a redis-server, 2 workers x 2 processes ...", flush=True)
            runs.append(_start(stack, prefix, api.url, variant, calls))
            api.latency[runs[-1].label] = variant.latency
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
    _report(res, runs, calls, time.time() - started)


def _report(res: Results, runs: Sequence[Run], calls: int, elapsed: float) -> None:
    best, fast = ideal(calls), fastest(calls)
    total = sum(tokens(i) for i in range(calls))
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
