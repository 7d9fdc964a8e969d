"""``python -m bench.after_deferral [--only rows|depth|controls|journal] [--runs N] [--quick]``.

rows (``deferral``): workers of tests/taskapp.py against what new capacity allows (:data:`ROWS`).
depth (``backlog``, 9): a ``20/s`` key with D tasks in its line on a test clock, released and claimed:
script time per task, the slowest call, bytes per waiting task. controls: P pauses in force: a refresh
reading the hash whole and by the stamp; a pause's script time before the stamp and now. journal:
RabbitMQ the broker, D tasks of a spent key: the producer's µs per task with the journal off and on,
the keeper's pass, and the recovery's two passes once the store is emptied.
"""

from __future__ import annotations

import argparse
import subprocess
import time
import uuid
from typing import Any

import redis

from bench.common import Results, md, standalone
from tests.harness import redis_server, waited

#: pause.lua before the stamp: it pruned by reading the whole hash.
BEFORE = "903274a"


def timed(*calls: Any) -> float:
    """Seconds ``calls`` took, one after the other."""
    t = time.perf_counter()
    for call in calls:
        call()
    return time.perf_counter() - t


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


def run_controls(res: Results, scale: Any, reads: int = 20) -> None:
    """Each figure the mean of ``reads`` calls, side by side."""
    from celery_throttle.check.control_set import pause_field
    from celery_throttle.check.controls import Controls
    from celery_throttle.core.state import FOREVER_US
    from celery_throttle.store.client import RedisStore

    old_lua = subprocess.run(["git", "show", f"{BEFORE}:celery_throttle/lua/pause.lua"], capture_output=True,
                             text=True, check=True).stdout
    lines = []
    with redis_server() as server:
        client = redis.Redis(port=server.port, socket_timeout=120)
        store, old = RedisStore(server.url, "bench"), client.register_script(old_lua)
        for size in scale.pauses:
            client.delete("bench:control")
            for start in range(0, size, 1000):
                client.hset("bench:control", mapping={pause_field("api", f"tenant-{i}"): str(FOREVER_US)
                                                      for i in range(start, min(size, start + 1000))})
            store.pause(pause_field("api", "stamped"), 600)
            whole = stamped = 0.0
            controls = Controls()
            controls.refresh(store)
            for _ in range(reads):
                whole += timed(store.controls)
                stamped += timed(lambda c=controls: c.refresh(store))
            client.config_resetstat()
            for i in range(reads):
                old(keys=["bench:control"], args=["", pause_field("api", f"old-{i}"), 60_000_000, FOREVER_US])
            before = client.info("commandstats")["cmdstat_evalsha"]["usec"] / reads
            client.config_resetstat()
            for i in range(reads):
                store.pause(pause_field("api", f"new-{i}"), 60)
            now = client.info("commandstats")["cmdstat_evalsha"]["usec"] / reads
            lines.append(f"| {size:,} | {whole / reads * 1e3:.2f} | {stamped / reads * 1e3:.3f} | {before:.0f} "
                         f"| {now:.0f} |")
        store.close()
    res.table("controls", md("| pauses in force | refresh, hash read whole (ms) | refresh by the stamp (ms) "
                             f"| a pause's script, before {BEFORE} (µs) | now (µs) |", lines))


def run_journal(res: Results, scale: Any) -> None:
    """A producer and a keeper in this process, RabbitMQ the broker, a redis-server the store."""
    from celery import Celery
    from kombu.connection import Connection
    from kombu.entity import Queue

    from celery_throttle import throttle
    from celery_throttle.check.limiter import Throttle
    from celery_throttle.core import journal
    from celery_throttle.integration.publish import wrap_send_task
    from celery_throttle.waits.keeper import Keeper
    from tests.conftest import RABBITMQ_URL
    from tests.helpers import delete_queues

    journal.LOST_AFTER_US = 0  # (the two passes of a recovery back to back: the keeper's cost alone)
    lines = []
    with redis_server() as server:
        client = redis.Redis(port=server.port, socket_timeout=120)
        for size in scale.journaled:
            per_send, queues = {}, []
            for on in (False, True):
                prefix = f"ct-bench-{uuid.uuid4().hex[:8]}"
                app = Celery("journal-bench", broker=RABBITMQ_URL, set_as_current=False)
                app.conf.task_default_queue = f"{prefix}-q"

                @app.task(name="bench.journaled", shared=False)
                @throttle("1/h")
                def work(n: int) -> None: ...

                ctl = Throttle(app, {"redis_url": server.url, "key_prefix": prefix, "journal": on})
                wrap_send_task(ctl)
                queues += [f"{prefix}-q", ctl.lines.journal.broker.name]
                t = time.perf_counter()
                for n in range(size):
                    work.delay(n)
                per_send[on] = (time.perf_counter() - t) / size * 1e6
            keeper = Keeper(ctl)
            keeper.pass_now()  # (the first adopts what it holds too: not timed)
            one_pass = timed(keeper.pass_now) / size * 1e6
            client.flushall()  # (the section's own server)
            recovery = timed(keeper.pass_now, keeper.pass_now) / size * 1e6
            with Connection(RABBITMQ_URL) as conn:  # (the broker counts the last publishes a moment later)
                queue = Queue(f"{prefix}-q")(conn.default_channel)
                waited(lambda q=queue, n=size: q.queue_declare(passive=True).message_count >= n, 10, 0.5)
                sent_on = queue.queue_declare(passive=True).message_count
            keeper._close()
            ctl.close()
            delete_queues(RABBITMQ_URL, queues)
            client.flushall()
            lines.append(f"| {size:,} | {per_send[False]:.0f} | {per_send[True]:.0f} | "
                         f"{per_send[True] / per_send[False]:.2f} | {one_pass:.0f} | {recovery:.0f} | {sent_on:,} |")
    res.table("journal", md("| tasks waiting | producer µs per task, journal off | on | on / off | keeper's pass, µs "
                            "per task | recovery's two passes, µs per task | tasks in the queue after them |", lines))


def main(argv: list[str] | None = None) -> int:
    from bench.__main__ import FULL, QUICK

    p = argparse.ArgumentParser(prog="python -m bench.after_deferral", description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("rows", "depth", "controls", "journal"), action="append", default=[])
    p.add_argument("--runs", type=int, help="runs of each row (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="depths to 10 000, fewer pauses and journaled tasks")
    args = p.parse_args(argv)
    scale = QUICK if args.quick else FULL
    scale = type(scale)(**{**vars(scale), "deferral_runs": args.runs}) if args.runs else scale
    parts = {"rows": ("deferral", run_rows), "controls": ("controls", run_controls), "journal": ("journal", run_journal),
             "depth": ("backlog", lambda r, s: depth_table(r, depths(("sliding",), s.depths)["sliding"]))}
    standalone("bench.after_deferral", argv, scale, not args.quick,
               *(part for name, part in parts.items() if not args.only or name in args.only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
