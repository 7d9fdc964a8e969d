"""``python -m bench [--quick] [--only NAME]``: the celery_throttle benchmark.

Each section (:data:`SECTIONS`) runs on redis-servers of its own and writes bench/out/; a full-scale
run also writes its headline cells and tables into bench/results.json, and bench/results.md from it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from bench.common import BENCH, MET, MISSED, OUT, ROOT, Results, md

#: name -> (module, function, aliases: the section numbers among them), in the order of a full run.
SECTIONS = {
    "burst": ("bench.bursts", "run_burst", ("1", "2", "3", "4", "violation", "makespan", "chart")),
    "backlog": ("bench.after_deferral", "run_backlog", ("9", "depth", "deep-line")),
    "neighbour": ("bench.bursts", "run_neighbour", ("10", "neighbor")),
    "api429": ("bench.api429", "run_api429", ("11", "api", "429")),
    "rpt": ("bench.redis_per_task", "run_rpt", ("12", "redis-per-task")),
    "slow": ("bench.bursts", "run_slow", ("13", "slow-store")),
    "llmsweep": ("bench.llm", "run_sweep", ("15b", "issue26")),
    "deferral": ("bench.after_deferral", "run_rows", ("rows", "after-deferral")),
    "adapt": ("bench.api429", "run_adapt", ("16", "adaptive", "issue29")),
    "share": ("bench.share", "run_share", ("17", "fair-share", "shared-slots")),
    "journal": ("bench.journal", "run_journal", ("44", "journal-cost")),
    "observe": ("bench.llm", "run_observe", ("46", "headers")),
    "shapes": ("bench.shapes", "run_shapes", ("46b", "adaptive-shapes")),
    "tenants": ("bench.tenants", "run_tenants", ("46c", "small-tenants")),
    "scripts": ("bench.scripts", "run_scripts", ("45", "script-cost")),
    "keys": ("bench.many_keys", "run_many_keys", ("47", "many-keys")),
}
ALIASES = {alias: name for name, (_, _, aliases) in SECTIONS.items() for alias in aliases}


@dataclass(frozen=True)
class Scale:
    """How big each section runs."""

    rate: str = "25/s"
    burst_tasks: int = 250
    depths: tuple[int, ...] = (100, 1_000, 10_000, 100_000)
    floods: tuple[int, ...] = (1_000, 10_000, 100_000)
    api_tasks: int = 150
    rpt_sizes: tuple[int, ...] = (1_000, 10_000, 100_000)
    slow_rounds: int = 3
    sweep_calls: int = 120
    sweep_latencies: tuple[float, ...] = (0.0, 1.0, 2.0, 3.0)
    deferral_runs: int = 3
    #: adaptive limits: calls per client, seconds of each phase but the last.
    adapt_calls: int = 3_000
    adapt_phase: float = 20.0
    #: a fair share (bench/share.py): a and b's tasks, alone's, the flood beside newcomers (how many, s apart),
    #: tenants beside a flood of the passes timed (over s), the trickle's (flood, one-task tenants, s apart).
    share_weighted: int = 150
    share_alone: int = 320
    share_flood: int = 480
    share_newcomers: tuple[int, float] = (5, 3.0)
    share_keys: tuple[int, ...] = (3, 30, 300)
    share_pass_s: float = 10.0
    share_trickle: tuple[int, int, float] = (480, 32, 0.25)
    #: the journal's price (bench/journal.py): tasks waiting.
    journal_sizes: tuple[int, ...] = (200, 1_000, 5_000)
    #: adaptive limits on moving shapes (bench/shapes.py): calls per client.
    shape_calls: int = 1_500
    quick: bool = False


FULL = Scale()
QUICK = Scale("20/s", 100, (100, 1_000, 10_000), (1_000, 10_000), 50, (1_000,), 1, 60, (0.0, 3.0), 1,
              900, 6.0, 40, 96, 200, (3, 2.0), (3, 30), 4.0, (200, 24, 0.25), (100, 500), shape_calls=1_500,
              quick=True)

#: The headline table (README, "Benchmark"): its rows, and its columns.
HEADLINE = {
    "window": "most starts in any window / limit",
    "makespan": "first-to-last start / ideal (target ≤ 1.05; the issue's ≤ 1.02)",
    "resends": "re-sends per task (target ≤ 0.95; ideal 0.90)",
    "aligned": "most starts in an aligned window / limit",
    "neighbour": "another tenant behind a flood of 1 000 / 10 000 / 100 000 sent first, p50",
    "api429": "429s per 100 tasks from an API of 10 calls in any 1 s",
    "rpt": "far under the limit, 100 000 / 10 000 / 1 000 tasks: script calls, Redis CPU / plain Celery "
           "(target ≤ 0.5, ≤ 1.3×)",
    "llmsweep": "an LLM API's requests and tokens per 10 s, calls of 0 / 1 / 2 / 3 s: 429s per 100, makespan / "
                "fastest compliant",
    "adapt": "an API whose limit moves 50 → 20 → 80/s unknown to the client (declared 100/s): 429s per 100, makespan "
             "/ the oracle's (a client told each limit; targets ≤ 2 429s per 100, ≤ 1.15)",
    "share": "`concurrency=8, share=True`, bodies of 0.5 s: starts / weight of 3 tenants flooding 1:1:2 (target within "
             "5 %); a tenant alone: the 8 slots used (≥ 0.95); a newcomer beside a flood: its slowest start (≤ 1 s); a "
             "flood beside a new one-task tenant every 0.25 s: the flood's use of the slots they leave (≥ 0.85). "
             "Per-key `concurrency=3` in brackets, plain Celery in the last column",
}
COLUMNS = ("sliding", "fixed", "naive fixed (seed)", "naive sliding log", "Celery `rate_limit`")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small scale, the sections' quickest runs")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help=f"run only this section (repeatable): {', '.join(SECTIONS)}")
    args = p.parse_args(argv)
    chosen = [ALIASES.get(n.strip().lower(), n.strip().lower()) for item in args.only for n in item.split(",")]
    for name in chosen:
        if name not in SECTIONS:
            p.error(f"unknown section {name!r}: use one of {', '.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in chosen] if chosen else list(SECTIONS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    scale = QUICK if args.quick else FULL
    command = "python -m bench" + (" --quick" if args.quick else "") + "".join(f" --only {s}" for s in args.only)
    shutil.rmtree(OUT / "logs", ignore_errors=True)
    res, started = Results(), time.time()
    try:
        for name in args.sections:
            module, function, _ = SECTIONS[name]
            section(res, name, getattr(importlib.import_module(module), function), scale)
    except KeyboardInterrupt:
        res.notes.append("interrupted")
    finish(res, command, time.time() - started, keep=not args.quick)
    return 0


def section(res: Results, name: str, run: Any, *args: Any) -> None:
    """Run one section; a failure is a row, and the run goes on. Its rows lead its tables."""
    print(f"== {name} ...", flush=True)
    first = len(res.rows)
    try:
        run(res, *args)
    except Exception as exc:  # noqa: BLE001 - a failed section is a row, the run goes on
        res.add(name, "section failed", "-", f"{type(exc).__name__}: {exc}"[:200], "", False)
        res.notes.append(f"{name} failed:\n{traceback.format_exc()[-1500:]}")
    cells = [(r.section, r.metric, r.variant, r.value, r.target, {MET: "met", MISSED: "**missed**"}.get(r.status, ""),
              r.note) for r in res.rows[first:]]
    if cells:
        res.tables.setdefault(name, []).insert(0, md("| Section | Metric | Variant | Value | Target | Status | Note |",
                                                     ("| " + " | ".join(str(x).replace("|", "/") for x in row) + " |"
                                                      for row in cells)))


def commit() -> str:
    """The checked-out commit, and whether celery_throttle/ differs from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    if os.environ.get("BENCH_COMMIT"):  # (a run from a `git archive` of that commit)
        return os.environ["BENCH_COMMIT"]
    return git("rev-parse", "--short", "HEAD") + (" + changes" if git("status", "--porcelain", "celery_throttle") else "")


def finish(res: Results, command: str, elapsed: float, keep: bool) -> None:
    """Print the rows, write bench/out/; ``keep``: the headline cells and the sections' tables into
    bench/results.json, and bench/results.md (and the chart) from it."""
    when = dt.datetime.now().isoformat(timespec="minutes")
    import celery
    import redis

    head = (f"`{command}`, {when}, {elapsed:.0f} s, at `{commit()}`; {os.cpu_count()} CPU cores, Python "
            f"{sys.version.split()[0]}, Celery {celery.__version__}, redis-py {redis.__version__}")
    text = "\n".join([f"# {command}", "", head] + [t for name, ts in res.tables.items()
                                                     for t in ("", f"## {name}", "", "\n\n".join(ts))]
                     + [""] + [f"- {n}" for n in res.notes])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.md").write_text(text + "\n", encoding="utf-8")
    (OUT / "results.json").write_text(json.dumps({"head": head, "rows": [asdict(r) for r in res.rows],
                                                  "notes": res.notes, "tables": res.tables, "series": res.series},
                                                 indent=1, default=str), encoding="utf-8")
    print(text, flush=True)
    if not keep:
        return
    path = BENCH / "results.json"
    kept = json.loads(path.read_text("utf-8")) if path.exists() else {"rows": {}, "tables": {}}
    source = f"`{command}`, {when[:10]}, `{commit()}`"
    for row, cells in res.headline.items():
        kept["rows"][row] = {"cells": cells, "source": source}
    for section, tables in res.tables.items():
        kept["tables"][section] = {"source": f"{head}", "text": "\n\n".join(tables)}
    path.write_text(json.dumps(kept, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    render(kept)
    if (OUT / "chart.png").exists() and "window" in res.headline:
        shutil.copyfile(OUT / "chart.png", BENCH / "chart.png")


def render(kept: dict[str, Any]) -> None:
    """bench/results.md from bench/results.json."""
    lines = ["# Benchmark results", "",
             "Generated by `python -m bench` from `bench/results.json`: a run of a section at full scale (not",
             "`--quick`) replaces its rows and its table, each row naming the run it is from. What each section",
             "measures: CONTRIBUTING.md, \"Benchmarks\"; the lab notes of earlier runs: docs/bench-notes.md.", "",
             f"| figure | {' | '.join(COLUMNS)} | measured by |", "|---" * (len(COLUMNS) + 2) + "|"]
    for row, figure in HEADLINE.items():
        got = kept["rows"].get(row)
        if got:
            lines.append(f"| {figure} | {' | '.join(got['cells'].get(c, '–') for c in COLUMNS)} | {got['source']} |")
    for section, table in kept["tables"].items():
        lines += ["", f"## {section}", "", table["source"], "", table["text"]]
    (BENCH / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
