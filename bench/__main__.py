"""``python -m bench [--quick] [--only NAME]``: the celery_throttle benchmark.

Sections: ``burst`` (1 violation, 2 makespan, 3 re-sends, 4 naive baselines, and the
chart), ``cost`` (5 check cost), ``overhead`` (6), ``memory`` (7), ``long`` (8 long waits),
``backlog`` (9 deep backlog cost, on a redis-server of its own), ``neighbour`` (10 noisy
neighbour), ``api429`` (11 429s from a real rate-limited API: Flask-Limiter under gunicorn),
``rpt`` (12 Redis per task, from usual producers, each run on a redis-server of its own),
``slow`` (13 a store 100 ms away, behind a delaying proxy), ``concurrency`` (14 slots: a
tenant's flood beside another, Redis per task, a SIGKILLed holder's slot reclaimed), ``llm``
(15 an LLM-style API limiting requests and tokens: estimates, settling, Celery's rate_limit),
``llmsweep`` (15b the same API per 10 s, calls of 0-3 s, against the fastest compliant
makespan: the throttle settled, Celery's rate_limit, a by-hand ``limits`` check).
Starts its own workers against the local Redis (dbs 10 and 11, which it owns; not touched
when only ``rpt`` runs), prints a table, writes bench/out/ (results.md, results.json,
chart.png, worker logs). A full run also writes bench/results.md and bench/chart.png, to
commit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from bench.common import BENCH_DIR, OUT_DIR, Results, broker_client, delete_prefix, new_prefix, store_client

SECTIONS = ("burst", "cost", "overhead", "memory", "long", "backlog", "neighbour", "api429", "rpt", "slow",
            "concurrency", "llm", "llmsweep")
#: Sections that use only servers of their own: a run of these alone leaves the local
#: Redis's databases 10 and 11 alone.
OWN_SERVERS = frozenset({"rpt", "concurrency", "llm", "llmsweep"})
ALIASES = {"1": "burst", "2": "burst", "3": "burst", "4": "burst", "violation": "burst",
           "makespan": "burst", "resends": "burst", "naive": "burst", "chart": "burst",
           "5": "cost", "checks": "cost", "6": "overhead", "7": "memory", "8": "long",
           "long-waits": "long", "9": "backlog", "deep-backlog": "backlog", "10": "neighbour",
           "neighbor": "neighbour", "noisy-neighbour": "neighbour", "11": "api429", "api": "api429",
           "429": "api429", "429s": "api429", "12": "rpt", "redis-per-task": "rpt", "per-task": "rpt",
           "13": "slow", "slow-store": "slow", "14": "concurrency", "slots": "concurrency", "15": "llm",
           "tokens": "llm", "15b": "llmsweep", "issue26": "llmsweep"}


@dataclass(frozen=True)
class Scale:
    """How big each section runs."""

    rate: str
    burst_tasks: int
    overhead_tasks: int
    overhead_rounds: int
    cost_seconds: float
    cost_rounds: int
    memory_limits: tuple[int, ...]
    tenants: int
    long_tasks: int
    long_window: int
    #: Reservations outstanding on one key, for the deep-backlog cost.
    backlog_depths: tuple[int, ...]
    #: Fitting calls per round, and rounds, against the peers.
    fit_calls: int
    fit_rounds: int
    #: Tasks of one key sent at once, end to end.
    backlog_tasks: int
    #: Tenant A's flood sizes in the noisy-neighbour run.
    floods: tuple[int, ...]
    #: API 429s: tasks per batch, the margins tried, the servers (bench.api429.SERVERS
    #: keys) that also get cold runs.
    api_tasks: int
    api_margins: tuple[float, ...]
    api_cold: tuple[str, ...]
    #: Tenant a's floods in the concurrency section.
    slot_floods: tuple[int, ...]
    #: Calls sent at once per client in the LLM section.
    llm_calls: int
    #: Calls per client, and the latencies swept, in section 15b.
    sweep_calls: int = 120
    sweep_latencies: tuple[float, ...] = (0.0, 1.0, 2.0, 3.0)


FULL = Scale("25/s", 250, 700, 5, 0.5, 6, (10, 1000, 100000), 100000, 20000, 150,
             backlog_depths=(100, 1000, 10000, 100000), fit_calls=15000, fit_rounds=3,
             backlog_tasks=3000, floods=(1000, 10000, 100000), api_tasks=150,
             api_margins=(0.0, 0.05, 0.1), api_cold=("moving", "fixed", "jitter"), slot_floods=(200, 2000),
             llm_calls=100)
QUICK = Scale("20/s", 100, 400, 2, 0.25, 2, (10, 1000, 10000), 10000, 2000, 20,
              backlog_depths=(100, 1000, 10000), fit_calls=5000, fit_rounds=2,
              backlog_tasks=1000, floods=(1000, 10000), api_tasks=50, api_margins=(0.05,),
              api_cold=("moving",), slot_floods=(200,), llm_calls=60, sweep_calls=60, sweep_latencies=(0.0, 3.0))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small scale, 1-2 minutes")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help=f"run only this section (repeatable): {', '.join(SECTIONS)} or 1-15, 15b")
    args = p.parse_args(argv)
    chosen = []
    for item in args.only:
        for name in item.split(","):
            name = ALIASES.get(name.strip().lower(), name.strip().lower())
            if name not in SECTIONS:
                p.error(f"unknown section {name!r}: use one of {', '.join(SECTIONS)} or 1-15")
            chosen.append(name)
    args.sections = [s for s in SECTIONS if s in chosen] if chosen else list(SECTIONS)
    return args


def _guard(res: Results, section: str, fn: Any, *a: Any) -> Any:
    """Run one section; a failure becomes a row and the run goes on."""
    try:
        return fn(*a)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        res.add(section, "section failed", "-", f"{type(exc).__name__}: {exc}"[:200], "", False)
        res.notes.append(f"{section} failed:\n{traceback.format_exc()[-1500:]}")
        return None


def _clean(prefix: str | None = None) -> None:
    """Databases 10 and 11 are the bench's own: emptied at start and end."""
    for client in (store_client(), broker_client()):
        if prefix:
            delete_prefix(client, prefix)
        client.flushdb()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    scale = QUICK if args.quick else FULL
    full_run = not args.quick and not args.only
    command = "python -m bench" + (" --quick" if args.quick else "")
    command += "".join(f" --only {s}" for s in args.only)
    prefix = new_prefix()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(OUT_DIR / "logs", ignore_errors=True)
    shared = not set(args.sections) <= OWN_SERVERS
    if shared:
        _clean()
    res = Results()
    started = time.time()
    groups: list[Any] = []
    try:
        if "burst" in args.sections or "overhead" in args.sections:
            from bench.workers import WorkerGroup

            group = WorkerGroup(prefix, "main", env={"CB_RATE": scale.rate, "CB_TRACE": "1"})
            groups.append(group)
            print(f"starting 2 workers x 2 processes ({prefix}) ...", flush=True)
            group.start()
            # Overhead first: Celery's rate_limit run (last of the bursts) can leave tasks
            # behind in the workers, which stopping the group then discards.
            if "overhead" in args.sections:
                _guard(res, "6 overhead", _overhead, res, group, scale)
                # Let the workers finish with the 10 000 tasks just run (their garbage
                # collections included) before a burst measures dispatch timing.
                time.sleep(5)
            if "burst" in args.sections:
                _guard(res, "1-4 burst", _burst, res, group, scale)
            group.stop()
            groups.remove(group)
        if "cost" in args.sections:
            from bench.checks import run_checks

            print("check cost ...", flush=True)
            _guard(res, "5 check cost", run_checks, res, prefix, scale.cost_seconds, scale.cost_rounds)
        if "memory" in args.sections:
            from bench.memory import run_memory

            print("memory ...", flush=True)
            _guard(res, "7 memory", run_memory, res, prefix, scale.memory_limits, scale.tenants)
        if "long" in args.sections:
            from bench.scenarios import run_long_wait

            print(f"long waits: {scale.long_tasks} tasks ...", flush=True)
            _guard(res, "8 long waits", run_long_wait, res, prefix, scale.long_tasks, scale.long_window,
                   args.quick)
        if "backlog" in args.sections:
            from bench.backlog import SEC as LINE_SEC
            from bench.backlog import run_deep_line

            print("deep line ...", flush=True)
            _guard(res, LINE_SEC, run_deep_line, res, prefix, scale.backlog_depths)
        if "neighbour" in args.sections:
            from bench.neighbour import run_neighbour

            print(f"noisy neighbour: floods of {', '.join(f'{n:,}' for n in scale.floods)} ...", flush=True)
            _guard(res, "10 noisy neighbour", run_neighbour, res, prefix, scale.floods)
        if "api429" in args.sections:
            from bench.api429 import SEC as API_SEC
            from bench.api429 import run_api429

            print(f"API 429s: batches of {scale.api_tasks} tasks against Flask-Limiter at 10 per 1 second "
                  "under gunicorn ...", flush=True)
            _guard(res, API_SEC, run_api429, res, prefix, scale.api_tasks, scale.api_margins, scale.api_cold,
                   args.quick)
        if "rpt" in args.sections:
            from bench.redis_per_task import run_redis_per_task

            print("Redis per task: usual producers, a redis-server of its own per run ...", flush=True)
            _guard(res, "12 Redis per task", run_redis_per_task, res, args.quick)
        if "slow" in args.sections:
            from bench.slow_store import run_slow_store

            print("slow store: a burst with the store 0 and 100 ms away ...", flush=True)
            _guard(res, "13 slow store", run_slow_store, res, prefix, 1 if args.quick else 3)
        if "concurrency" in args.sections:
            from bench.concurrency import SEC as SLOTS_SEC
            from bench.concurrency import run_concurrency

            print("concurrency: K=4 per tenant, 2 workers x 4 processes, a redis-server of its own per run ...",
                  flush=True)
            _guard(res, SLOTS_SEC, run_concurrency, res, prefix, scale.slot_floods)
        if "llm" in args.sections:
            from bench.llm import SEC as LLM_SEC
            from bench.llm import run_llm

            print(f"LLM API: {scale.llm_calls} calls at once per client against 60 requests and 10 000 tokens "
                  "a minute, the clients side by side, a redis-server of its own each ...", flush=True)
            _guard(res, LLM_SEC, run_llm, res, prefix, scale.llm_calls)
        if "llmsweep" in args.sections:
            from bench.llm import SWEEP_SEC, run_sweep

            print(f"LLM sweep: {scale.sweep_calls} calls at once per client against 20 requests and 4 000 tokens "
                  f"per 10 s, calls of {', '.join(f'{x:g}' for x in scale.sweep_latencies)} s, the 3 clients side by "
                  "side, a redis-server of its own each ...", flush=True)
            _guard(res, SWEEP_SEC, run_sweep, res, prefix, scale.sweep_calls, scale.sweep_latencies)
    except KeyboardInterrupt:
        res.notes.append("interrupted")
    finally:
        from bench.workers import stop_all

        stop_all(groups)
        if shared:
            _clean(prefix)
    elapsed = time.time() - started
    _finish(res, command, elapsed, full_run)
    return 0


def _burst(res: Results, group: Any, scale: Scale) -> None:
    from bench.chart import draw
    from bench.scenarios import BURST_VARIANTS, report_bursts, run_burst

    runs = []
    for variant, task in BURST_VARIANTS:
        print(f"burst: {variant}, {scale.burst_tasks} tasks at {scale.rate} ...", flush=True)
        runs.append(run_burst(group, variant, task, scale.burst_tasks, scale.rate))
    report_bursts(res, runs)
    _trace_notes(res, group, runs)
    res.series["burst"] = {r.variant: {"times": r.times, "limit": r.limit, "window": r.window} for r in runs}
    title = (f"{scale.burst_tasks} tasks sent at once, limit {scale.rate}, "
             "2 workers x 2 prefork processes")
    draw(res.series["burst"], OUT_DIR / "chart.png", title)


def _trace_notes(res: Results, group: Any, runs: list[Any]) -> None:
    """How late denied tasks came back, from the traced denials (celery_throttle only)."""
    from bench.scenarios import return_lateness

    for run in runs:
        if run.variant not in ("sliding", "fixed"):
            continue
        stats = return_lateness(group, f"burst-{run.variant}")
        if stats:
            res.add("3 re-sends", "return after due: p50 / p90 / max", run.variant,
                    " / ".join(f"{x * 1000:.0f} ms" for x in stats[1:]), "", None,
                    f"first-round denials took {stats[0]:.2f}s")


def _overhead(res: Results, group: Any, scale: Scale) -> None:
    from bench.scenarios import report_overhead, run_overhead

    print(f"overhead: {scale.overhead_tasks} no-op tasks x {scale.overhead_rounds} rounds ...", flush=True)
    rates = run_overhead(group, scale.overhead_tasks, scale.overhead_rounds)
    report_overhead(res, rates, scale.overhead_tasks)


def _finish(res: Results, command: str, elapsed: float, full_run: bool) -> None:
    from bench import report

    meta = {"command": command, "when": dt.datetime.now().isoformat(timespec="seconds"),
            "elapsed_s": elapsed, "machine": report.machine(), "commit": report.commit()}
    report.print_table(res, f"{command} — {elapsed:.0f} s")
    paths = [OUT_DIR / "results.md"] + ([BENCH_DIR / "results.md"] if full_run else [])
    report.write(res, meta, paths)
    report.write_json(res, meta, OUT_DIR / "results.json")
    chart = OUT_DIR / "chart.png"
    if full_run and chart.exists() and "burst" in res.series:
        shutil.copyfile(chart, BENCH_DIR / "chart.png")
    print(f"wrote {', '.join(str(p) for p in paths)}" + (f", {chart}" if chart.exists() else ""))


if __name__ == "__main__":
    sys.exit(main())
