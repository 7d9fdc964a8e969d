"""``python -m bench.after_deferral [--only rows|depth] [--runs N] [--quick]``.

rows (``deferral``): workers of tests/taskapp.py against what new capacity allows (:data:`ROWS`).
depth (``backlog``, 9): a ``20/s`` key with D tasks in its line on a test clock, released and claimed:
script time per task, the slowest call, bytes per waiting task.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import redis

from bench.common import Results, md, standalone
from tests.harness import redis_server

#: The rows: what each measures, the ideal, the figure before the line.
ROWS = {"raise": ("raise 6/m to 600/m, 54 waiting: s from the raise to the last start", 0.0, "0 of 54 in 25 s"),
        "reset": ("reset and raise to 300/m, 24 waiting: s to the last start", 0.0, "5 of 30 within 25 s"),
        "refunds": ("30 calls at 10/4s, estimate 5, charge(1): first to last start, s", 16.0, "57.9 s"),
        "slow": ("40 bodies of 1 s, 2 processes, 10/2s: makespan, s", 20.0, "36.9 s")}


def run_rows(res: Results, scale: Any) -> None:
    import celery_throttle
    from tests.helpers import WorkerGroup, new_label
    from tests.taskapp import app as tasks_app

    figures: dict[str, list[float]] = {what: [] for what in ROWS}
    with redis_server() as server:
        url = f"redis://127.0.0.1:{server.port}"

        def group(**kw: Any) -> WorkerGroup:
            return WorkerGroup(f"ct-bench-{uuid.uuid4().hex[:10]}", f"{url}/13", f"{url}/12", records=f"{url}/12",
                               env={"CT_REDIS": url, "CT_BACKEND": f"{url}/13", **kw.pop("env", {})}, **kw)

        def sent(g: WorkerGroup, task: str, count: int, first: int = 0, what: str = "") -> tuple[str, str, float]:
            label, tenant = new_label(), f"{what}-{new_label()}"
            g.produce({"how": "delay", "task": task, "args": [label, tenant], "count": count})
            return label, tenant, time.time() if not first else g.wait_starts(label, first, timeout=30) and time.time()

        four = group().start()
        ctl = celery_throttle.Throttle(tasks_app, {"redis_url": f"{url}/12", "key_prefix": four.prefix})
        try:
            for _ in range(scale.deferral_runs):
                for what, count, limit in (("raise", 60, "600/m"), ("reset", 30, "300/m")):
                    label, tenant, at = sent(four, "raisable", count, 6, what)
                    if what == "reset":
                        ctl.reset("raisable", key=tenant)
                    ctl.set_limit("raisable", [limit], key=tenant)
                    figures[what].append(max(e["t"] for e in four.wait_starts(label, count, timeout=60)) - at)
                times = sorted(e["t"] for e in four.wait_starts(sent(four, "refunded", 30)[0], 30, timeout=90))
                figures["refunds"].append(times[-1] - times[0])
        finally:
            ctl.close()
            four.stop()
        for _ in range(scale.deferral_runs):
            two = group(count=1, concurrency=2, env={"CT_PREFETCH": "1"}).start()
            try:
                times = sorted(e["t"] for e in two.wait_starts(sent(two, "slow_body", 40)[0], 40, timeout=90))
                figures["slow"].append(times[-1] + 1.0 - times[0])
            finally:
                two.stop()
    lines = []
    for what, (name, ideal, before) in ROWS.items():
        got = figures[what]
        worst = f"{max(got) / ideal:.3f}" if ideal else f"{max(got):.2f} s over"
        lines.append(f"| {name} | {', '.join(f'{f:.2f}' for f in got)} | {ideal:.1f} | {worst} | before: {before} |")
    res.table("deferral", md(f"| capacity after the deferral ({scale.deferral_runs} runs) | runs | ideal | worst / ideal "
                             "| before |", lines))


def deep_line(client: Any, url: str, algorithm: str, depth: int, measured: int = 400) -> dict[str, float]:
    """Fill one key's line to ``depth``, then release and claim ``measured`` of its tasks."""
    from celery_throttle.core.keys import state_key, window_keys
    from celery_throttle.core.protocol import Code, Entry, WindowCall
    from celery_throttle.core.rates import parse_rate
    from celery_throttle.store.client import RedisStore

    clock = [1_700_000_000_000_000]
    store = RedisStore(url, "deep", clock=lambda: clock[0])
    call = WindowCall(algorithm, (parse_rate("20/s"),), 1, slack_us=10_000)
    key = state_key("deep", "deep", f"{algorithm}-{depth}")
    try:
        for n in range(depth + 20):  # (20 fit the window; the rest wait)
            store.acquire(key, call, entry=Entry(f"t{n}", b"x" * 300, f"t{n}", 0, 0, 8))
        keys = window_keys(key)
        line_bytes = sum(client.memory_usage(k) or 0 for k in keys[1:5])
        client.config_resetstat()
        client.slowlog_reset()
        released, codes, measured = 0, set(), min(measured, depth)
        while released < measured:
            reply = store.release(key, call, 64)
            for r in reply.reported:
                codes.add(store.claim(key, call, r.id, early_us=1_000_000, holder=f"h{r.id}").code)
                released += 1
            clock[0] = max(reply.due_us, clock[0] + 1_000) if reply.due_us else clock[0] + 50_000
        stat = client.info("commandstats").get("cmdstat_evalsha") or {}
        slowest = max((int(e["duration"]) for e in client.slowlog_get(-1) if e["command"].startswith(b"EVALSHA ")),
                      default=0)
        return {"us": int(stat.get("usec", 0)) / released, "calls": int(stat.get("calls", 0)) / released,
                "slowest": slowest, "bytes": line_bytes / depth, "all_ran": float(codes <= {Code.RUN, Code.RUN_AT})}
    finally:
        for k in client.scan_iter(match="deep:*", count=1000):
            client.delete(k)
        store.close()


def depths(algorithms: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, list[tuple[int, dict[str, float]]]]:
    with redis_server("--slowlog-log-slower-than", "0", "--slowlog-max-len", "20000") as server:
        client = redis.Redis(port=server.port, socket_timeout=120)
        return {a: [(d, deep_line(client, server.url, a, d)) for d in sizes] for a in algorithms}


def run_backlog(res: Results, scale: Any) -> None:
    sec = "9 deep line"
    for algorithm, runs in depths(("sliding", "fixed"), scale.depths).items():
        worst = max(r["us"] for _, r in runs) / runs[0][1]["us"]
        res.add(sec, "script µs per task released and claimed, by tasks in the line", algorithm,
                " · ".join(f"{d:,}: {r['us']:.0f}" for d, r in runs), f"<= 1.3x depth {runs[0][0]:,}",
                worst <= 1.3 and all(r["all_ran"] for _, r in runs),
                "script calls per task: " + " · ".join(f"{r['calls']:.2f}" for _, r in runs))
        res.add(sec, "slowest call (µs)", algorithm, " · ".join(f"{d:,}: {r['slowest']:.0f}" for d, r in runs),
                "< 1000 µs", max(r["slowest"] for _, r in runs) < 1000, "SLOWLOG (a release call sends up to 64)")
        res.add(sec, "bytes per waiting task (a message of 300 B each)", algorithm,
                " · ".join(f"{d:,}: {r['bytes']:.0f}" for d, r in runs))
        if algorithm == "sliding":
            depth_table(res, runs)


def depth_table(res: Results, runs: list[tuple[int, dict[str, float]]]) -> None:
    res.table("backlog", md("| tasks in the line | script µs per task released and claimed | bytes per waiting task |",
                            (f"| {d:,} | {r['us']:.0f} | {r['bytes']:.0f} |" for d, r in runs)))


def main(argv: list[str] | None = None) -> int:
    from bench.__main__ import FULL, QUICK

    p = argparse.ArgumentParser(prog="python -m bench.after_deferral", description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("rows", "depth"), action="append", default=[])
    p.add_argument("--runs", type=int, help="runs of each row (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="depths to 10 000, one run of each row")
    args = p.parse_args(argv)
    scale = QUICK if args.quick else FULL
    scale = type(scale)(**{**vars(scale), "deferral_runs": args.runs}) if args.runs else scale
    parts = {"rows": ("deferral", run_rows),
             "depth": ("backlog", lambda r, s: depth_table(r, depths(("sliding",), s.depths)["sliding"]))}
    standalone("bench.after_deferral", argv, scale, not args.quick,
               *(part for name, part in parts.items() if not args.only or name in args.only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
