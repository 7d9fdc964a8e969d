"""Section 17 (share, issue 29 item 2): a fair share of a scope's slots.

bench/app.py's ``share_fair``: ``concurrency=8`` over the scope, ``share=Share(weight=...)`` (``heavy``
weighs 2), on 2 workers x 4 (the share binds, not the pool); bodies of 0.5 s (long against a pass,
short enough for a newcomer's 1 s). Each run: the broker and notes on a redis-server, the store alone
on another; a producer sends before the workers start. Beside it, per-key ``concurrency=3`` (3 tenants
hold 9 > 8: the pool binds) and plain Celery (FIFO).

1. weights: a, b send N, heavy 2N: each one's share of the starts while all three wait (within 5 %).
2. alone: one tenant's flood: its body time / (K x first start to last end) (>= 95 %).
3. newcomer: once 2K bodies of a flood began, another tenant sends one task M times, S s apart: each
   one's start after its send (<= 1 s; no body is stopped).
4. trickle: beside a flood, a new tenant sends ONE task of 0.05 s every 0.25 s: the flood's body
   time against what the one-shots leave (>= 85 %), and their start after send.
5. cost: the store's commands per task in run 1, the workers' sharer's passes per second; one pass
   over 3, 30, 300 tenants of one task beside a flood, by a sharer of the bench's process that holds
   the scope's lock: timed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis
from celery import Celery

from bench.app import PER_KEY, SHARE_K, SHARE_SCOPE, SHARE_WEIGHTS
from bench.common import Counts, Results, after_send, counts, most_at_once, percentile, produce, served
from celery_throttle import Throttle
from celery_throttle.core.keys import share_registry_key
from celery_throttle.waits.sharer import Sharer
from tests.harness import waited

SEC, K, BODY_S, PROCESSES, SETTLE_S = "17 fair share", SHARE_K, 0.5, 8, 1.0
TENANTS = ("a", "b", "heavy")
SHARED = "share=True"
#: name, task: the shared scope, per-key slots, plain Celery.
VARIANTS = ((SHARED, "share_fair"), (f"concurrency={PER_KEY} per key", "share_per_key"), ("plain Celery", "share_plain"))
SHARE_TARGET, USE_TARGET, NEWCOMER_TARGET = 0.05, 0.95, 1.0
#: the trickle (4): a one-shot's body (s), the flood's use of what the one-shots leave.
ONE_S, TRICKLE_TARGET = 0.05, 0.85


class Span(NamedTuple):
    t0: float
    t1: float
    tenant: str
    id: str
    worker: str


@dataclass
class Run:
    """What one run saw: its bodies, the late sends, the store's counts and commands, the
    passes of the workers' sharer over the shared scope (bench/app.py counts them)."""

    spans: list[Span]
    late: list[dict[str, Any]]
    cost: Counts
    calls: dict[str, int]
    seconds: float
    errors: list[str] = field(default_factory=list)
    passes: int = 0

    @property
    def tasks(self) -> int:
        return len(self.spans)


def commandstats(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v.get("calls", 0))
            for name, v in client.info("commandstats").items() if isinstance(v, dict)}


def body(tenant: str, count: int = 1) -> dict[str, Any]:
    return {"task": "", "args": [tenant, BODY_S], "count": count}


def sends_of(task: str, *sends: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**s, "task": task} for s in sends]


def run(task: str, sends: Sequence[dict[str, Any]], late: Sequence[dict[str, Any]] = (),
        env: dict[str, str] | None = None, processes: int = PROCESSES // 2, k: int = K) -> Run:
    """``sends`` published before the workers start; ``late`` once 2k bodies began. Waits for every body.
    The workers (2 x ``processes``) run at Celery's defaults (prefetch 4, acks on receipt) unless ``env``
    says otherwise."""
    with (served("share", apart=True, start=False, concurrency=processes,
                 env={"BENCH_SHARER_PASSES": "1", **(env or {})}) as (store_server, group),
          redis.Redis(port=store_server.port) as store):
        before, calls = counts(store), commandstats(store)
        produce(group, *sends_of(task, *sends))
        started = time.time()
        group.start()
        got: list[dict[str, Any]] = []
        if late:
            group.await_noted("began", 2 * k, 120, 0.02)
            got = produce(group, *sends_of(task, *late))
        total = sum(s["count"] for s in (*sends, *late))
        group.await_noted("spans", total, total * BODY_S / PER_KEY + 120, 0.2)
        cost, after = counts(store) - before, commandstats(store)
        spans = [Span(float(t0), float(t1), *more) for t0, t1, *more in group.noted("spans")]
        return Run(spans, got, cost, {k: n - calls.get(k, 0) for k, n in after.items() if n > calls.get(k, 0)},
                   max(s.t1 for s in spans) - started, group.errors(), group.note(f"passes:{SHARE_SCOPE}"))


def weight_of(tenant: str) -> float:
    return SHARE_WEIGHTS.get(tenant, 1) / sum(SHARE_WEIGHTS.get(t, 1) for t in TENANTS)


def shares(spans: Sequence[Span]) -> tuple[dict[str, float], int, float]:
    """Each tenant's share of the starts while all three wait (from the first start +
    SETTLE_S to the first last start of a tenant), how many starts, over how long."""
    first = min(s.t0 for s in spans)
    last = min(max(s.t0 for s in spans if s.tenant == t) for t in TENANTS)
    window = [s for s in spans if first + SETTLE_S <= s.t0 <= last]
    return ({t: sum(1 for s in window if s.tenant == t) / max(len(window), 1) for t in TENANTS}, len(window),
            last - first - SETTLE_S)


def use(spans: Sequence[Span], since: float | None = None, k: int = K) -> float:
    """Body time / (k x first start (or ``since``) to last end), bodies clipped to it."""
    start, end = since if since is not None else min(s.t0 for s in spans), max(s.t1 for s in spans)
    return sum(max(0.0, s.t1 - max(s.t0, start)) for s in spans) / (k * (end - start))


def weights_rows(res: Results, name: str, got: Run) -> None:
    share, n, over = shares(got.spans)
    off = {t: share[t] / weight_of(t) - 1 for t in TENANTS}
    res.add(SEC, "1:1:2 flood: share of starts while all three wait (× its weight)", name,
            ", ".join(f"{t} {share[t]:.3f} ({share[t] / weight_of(t):.2f}×)" for t in TENANTS),
            f"each within {SHARE_TARGET:.0%} of its weight", max(abs(v) for v in off.values()) <= SHARE_TARGET,
            f"{n} starts in {over:.1f} s, from the first start + {SETTLE_S:g} s (caps being set) to a tenant's "
            f"last start; weights 0.25 / 0.25 / 0.50", name == SHARED)
    if name == SHARED:
        most = most_at_once(got.spans)
        res.add(SEC, "most bodies of the scope running at once", name, str(most), f"<= {K}", most <= K,
                f"{got.tasks} bodies of a, b, heavy")


def alone_rows(res: Results, name: str, got: Run) -> float:
    firsts = {w: min(s.t0 for s in got.spans if s.worker == w) for w in {s.worker for s in got.spans}}
    second = max(firsts.values())
    value, makespan = use(got.spans), max(s.t1 for s in got.spans) - min(s.t0 for s in got.spans)
    res.add(SEC, f"a tenant alone: body time / ({K} slots x first start to last end)", name,
            f"{value:.3f} ({makespan:.1f} s for {got.tasks} bodies; ideal {got.tasks * BODY_S / K:.1f} s)",
            f">= {USE_TARGET:.0%}", value >= USE_TARGET,
            f"from the second worker's first start ({second - min(firsts.values()):.2f} s after the first): "
            f"{use(got.spans, second):.3f}", name == SHARED)
    return value


def newcomer_rows(res: Results, name: str, got: Run, flood: int) -> list[float]:
    count, latency = len(got.late[0]["ids"]), after_send(got.late, ((s.id, s.t0) for s in got.spans))
    ours = name == SHARED
    res.add(SEC, f"newcomer beside a flood: start after send, min / median / max of {count}", name,
            f"{latency[0]:.2f} / {percentile(latency, 0.5):.2f} / {latency[-1]:.2f} s" if latency else "none ran",
            f"max <= {NEWCOMER_TARGET:g} s", bool(latency) and latency[-1] <= NEWCOMER_TARGET,
            f"one task at a time, {count} times; the flood of {flood} sent before the workers started"
            + ("; no flood body is stopped: the first to end after the cap is lowered makes room" if ours else ""),
            ours)
    return latency


def trickle_rows(res: Results, name: str, got: Run, flood: int) -> float:
    """The flood's use of the slots while the trickle runs, and the one-shots' start after send."""
    send = got.late[0]
    lo, hi = send["times"][0], send["times"][-1]
    span, count = hi - lo, len(send["ids"])
    held = {solo: sum(max(0.0, min(s.t1, hi) - max(s.t0, lo)) for s in got.spans if (s.tenant == "solo") == solo)
            for solo in (True, False)}
    flood_s, ones_s = held[True], held[False]
    left = K * span - ones_s
    ratio, ours = flood_s / left, name == SHARED
    res.add(SEC, f"flood beside a trickle of one-task tenants: the flood's body time / ({K} slots x the trickle's "
                 "span)", name,
            f"{flood_s / (K * span):.3f} ({flood_s / span:.2f} of {K} slots); {ratio:.3f} of what the one-shots "
            "leave", f">= {TRICKLE_TARGET:.0%} of what they leave", ratio >= TRICKLE_TARGET,
            f"{count} tenants of one task of {ONE_S:g} s, one each {span / max(count - 1, 1):.2f} "
            f"s over {span:.1f} s, beside a flood of {flood} bodies of {BODY_S:g} s; the one-shots held "
            f"{ones_s / span:.2f} slots, idle {(left - flood_s) / span:.2f}"
            + (f"; the sharer's passes {got.passes / got.seconds:.1f}/s over the run" if ours else ""), ours)
    latency = after_send(got.late, ((s.id, s.t0) for s in got.spans))
    res.add(SEC, f"the trickle's one-shots: start after send, median / max of {count}", name,
            f"{percentile(latency, 0.5):.2f} / {latency[-1]:.2f} s" if latency else "none ran",
            f"max <= {NEWCOMER_TARGET:g} s", bool(latency) and latency[-1] <= NEWCOMER_TARGET,
            f"each a tenant of its own (one0, one1, ...); {len(latency)} of {count} ran", ours)
    return ratio


def cost_rows(res: Results, runs: dict[str, Run]) -> None:
    names = sorted({c for got in runs.values() for c, n in got.calls.items() if n / got.tasks >= 0.05 and c != "info"},
                   key=lambda c: -max(got.calls.get(c, 0) / got.tasks for got in runs.values()))
    lines = ["| command | " + " | ".join(f"{name}: per task" for name in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    lines += [f"| {c.upper()} | " + " | ".join(f"{got.calls.get(c, 0) / got.tasks:.2f}" for got in runs.values()) + " |"
              for c in names]
    for name, got in runs.items():
        res.add(SEC, "the store per task (run 1): commands (all) / script calls; its CPU", name,
                f"{got.cost.commands / got.tasks:.1f} / {got.cost.script_calls / got.tasks:.2f}; "
                f"{got.cost.cpu_s / got.tasks * 1e6:.0f} µs", note="a redis-server for the store alone; INFO "
                "commandstats counts the commands each script runs too")
    if ours := runs.get(SHARED):
        res.add(SEC, "sharer passes per second (run 1)", SHARED, f"{ours.passes / ours.seconds:.1f}/s",
                note=f"{ours.passes} passes in {ours.seconds:.1f} s (the workers' start to the last end), counted "
                     "by bench/app.py in the notes")
    res.table("share", "The store's commands per task in run 1 (1:1:2), INFO commandstats of a redis-server for the store "
                       "alone (the broker and the notes on another), from the producer's start to the last body's "
                       "end; a script's own commands counted too\n\n" + "\n".join(lines))


class TimedSharer(Sharer):
    """The workers' sharer, run in the bench's process for the shared scope: each pass timed."""

    def __init__(self, ctl: Throttle) -> None:
        super().__init__(ctl.setup, ctl.checker, ctl.lines)
        self.passes: list[tuple[float, float]] = []  # (when, seconds)

    def scopes(self) -> dict[str, int]:
        return {SHARE_SCOPE: K}

    def share(self, scope: str, total: int) -> tuple[dict[str, int], list[str]]:
        began = time.perf_counter()
        try:
            return super().share(scope, total)
        finally:
            self.passes.append((time.time(), time.perf_counter() - began))


def pass_cost(tenants: int, seconds: float) -> dict[str, Any]:
    """A flood and ``tenants`` tenants of one task each, sent before the workers start; the
    passes of a sharer in this process over ``seconds`` from the first start + SETTLE_S."""
    flood = round(2 * K / BODY_S * (seconds + 6))  # (lasts beyond the measure even with every slot)
    with served("share-pass", apart=True, start=False, concurrency=PROCESSES // 2,
                env={"CT_PREFETCH": "1"}) as (store_server, group):
        ctl = Throttle(Celery("bench-sharer", broker="memory://", set_as_current=False),
                       {"redis_url": store_server.url, "key_prefix": group.prefix})
        sharer = TimedSharer(ctl)
        try:
            # (its lock taken on its own thread, which extends it: redis-py keeps a lock's token
            # per thread; taken before the workers start, whose sharers stand by)
            sharer.start()
            if not waited(lambda: SHARE_SCOPE in sharer._locks, 10, 0.02):
                raise RuntimeError("the bench's sharer could not take the scope's lock")
            produce(group, {"task": "share_fair", "args": ["flood", BODY_S], "count": flood},
                    *({"task": "share_fair", "args": [f"t{i:03d}", BODY_S]} for i in range(tenants)))
            members = int(ctl.store._redis.hlen(share_registry_key(group.prefix, SHARE_SCOPE)))
            group.start()
            group.await_noted("began", 1, 120, 0.02)
            first = float(group.noted("began")[0][0])
            time.sleep(max(0.0, first + SETTLE_S + seconds - time.time()))
            sharer.stop()
            sharer.join(10)
            lo, hi = first + SETTLE_S, first + SETTLE_S + seconds
            window = [p for p in sharer.passes if lo <= p[0] <= hi]
            # (slots used in the window: every body begun, to its end or, not ended yet, to the window's)
            ends = {t0: float(t1) for t0, t1, *_ in group.noted("spans")}
            bodies = [(float(t0), ends.get(t0, hi), who) for t0, who, _ in group.noted("began")]
            held = sum(max(0.0, min(t1, hi) - max(t0, lo)) for t0, t1, _ in bodies)
            singles = sum(1 for t0, _, who in bodies if who != "flood" and t0 <= hi)
            return {"tenants": tenants, "members": members, "passes": window, "seconds": seconds,
                    "use": held / (K * seconds), "singles": singles, "errors": group.errors()}
        finally:
            sharer.stop()
            ctl.close()


def pass_rows(res: Results, got: dict[str, Any]) -> None:
    passes = got["passes"]
    if not passes:
        res.add(SEC, f"one pass over {got['tenants']} tenants and a flood", SHARED, "no pass measured")
        return
    took = sorted(p[1] * 1e3 for p in passes)
    res.add(SEC, f"one pass over {got['tenants']} tenants (1 task each) beside a flood: time p50 / p90 / max",
            f"{SHARED} ({got['members']} keys)",
            f"{percentile(took, 0.5):.1f} / {percentile(took, 0.9):.1f} / {took[-1]:.1f} ms",
            note=f"{len(passes)} passes in {got['seconds']:g} s ({len(passes) / got['seconds']:.1f}/s), each followed "
                 f"by a BLPOP (its wait, not timed); the sharer in the bench's process; slots used "
                 f"{got['use']:.2f}, {got['singles']} of the {got['tenants']} single tasks started")


def run_share(res: Results, scale: Any) -> None:
    n, alone, flood = scale.share_weighted, scale.share_alone, scale.share_flood
    late_count, late_every = scale.share_newcomers
    trickle_flood, ones, ones_every = scale.share_trickle
    late = [{"args": ["late", BODY_S], "count": late_count, "pace": late_every, "ids": True}]
    trickle = [{"args": [ONE_S], "vary": [f"one{i}" for i in range(ones)], "vary_at": 0, "count": ones,
                "pace": ones_every, "ids": True}]
    cells: dict[str, str] = {}
    first_runs: dict[str, Run] = {}
    for name, task in VARIANTS:
        print(f"  fair share: {name}: 1:1:2 ({4 * n} tasks) ...", flush=True)
        got = first_runs[name] = run(task, [body("a", n), body("b", n), body("heavy", 2 * n)])
        weights_rows(res, name, got)
        weights = " / ".join(f"{share / weight_of(t):.2f}" for t, share in shares(got.spans)[0].items())
        print(f"  fair share: {name}: alone ({alone} tasks) ...", flush=True)
        used = alone_rows(res, name, run(task, [body("solo", alone)]))
        print(f"  fair share: {name}: newcomer ({late_count} beside {flood}) ...", flush=True)
        got_late = run(task, [body("solo", flood)], late)
        latency = newcomer_rows(res, name, got_late, flood)
        print(f"  fair share: {name}: trickle ({ones} one-task tenants beside {trickle_flood}) ...", flush=True)
        got_trickle = run(task, [body("solo", trickle_flood)], trickle)
        ratio = trickle_rows(res, name, got_trickle, trickle_flood)
        cells[name] = f"{weights}; {used:.2f}; {f'{latency[-1]:.2f} s' if latency else 'none'}; {ratio:.2f}"
        for label, g in (("1:1:2", got), ("newcomer", got_late), ("trickle", got_trickle)):
            res.errors(f"fair share, {name}, {label}", g.errors)
    cost_rows(res, {name: got for name, got in first_runs.items() if name != "plain Celery"})
    for tenants in scale.share_keys:
        print(f"  fair share: one pass over {tenants} tenants ...", flush=True)
        pass_rows(res, pass_cost(tenants, scale.share_pass_s))
    res.cell("share", "sliding", f"{cells[SHARED]} (per key: {cells[VARIANTS[1][0]]})")
    res.cell("share", "Celery `rate_limit`", f"plain Celery: {cells['plain Celery']}")
