"""The demo: real workers, local Redis, bursts well over their limits, limits holding.

    python -m examples.demo

It finds Redis at 127.0.0.1:6379 (or DEMO_REDIS_URL), or starts a throwaway
``redis-server`` on a free port; starts two Celery workers (two processes each); sends
bursts for two tenants and one shared API scope, several times their limits; shows
progress live; and ends with a per-window summary of what really started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
console = Console()

# stream -> (limit, window seconds, tasks to send)
STREAMS = {
    "export:acme": (8, 1.0, 48),
    "export:globex": (3, 1.0, 18),
    "github-api": (6, 1.0, 36),
}


def find_redis() -> tuple[str, subprocess.Popen | None]:
    url = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        return url, None
    except redis.RedisError:
        pass
    binary = shutil.which("redis-server")
    if binary is None:
        console.print(
            f"[red]No Redis answers at {url} and no redis-server binary was found.[/]\n"
            "Fix: start one (e.g. `apt-get install redis-server && redis-server --daemonize yes`), "
            "or point DEMO_REDIS_URL at yours."
        )
        sys.exit(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tempfile.gettempdir()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            console.print(f"Started a throwaway redis-server on port {port}.")
            return url, proc
        except redis.RedisError:
            time.sleep(0.05)
    sys.exit("redis-server did not start")


def start_workers(env: dict[str, str], logdir: Path) -> list[subprocess.Popen]:
    procs = []
    for i in range(2):
        log = open(logdir / f"worker{i}.log", "wb")
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
    return procs


def max_in_window(times: list[float], window: float) -> int:
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def progress_table(starts: dict[str, list[float]], denials: dict[str, int], t0: float) -> Table:
    table = Table(title="celery_throttle demo: 2 workers x 2 processes, one Redis")
    for col in ("stream", "limit", "sent", "started", "waiting", "re-sent", "last 1 s",
                "max in any 1 s"):
        table.add_column(col, justify="right" if col != "stream" else "left")
    now = time.time()
    for stream, (limit, window, total) in STREAMS.items():
        ts = starts.get(stream, [])
        recent = sum(1 for t in ts if now - t < window)
        peak = max_in_window(ts, window)
        colour = "green" if peak <= limit else "red"
        table.add_row(stream, f"{limit}/s", str(total), str(len(ts)), str(total - len(ts)),
                      str(denials.get(stream, 0)), str(recent), f"[{colour}]{peak}[/]")
    table.caption = f"{now - t0:5.1f} s elapsed"
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


def summary(records: list[dict], denials: dict[str, int]) -> bool:
    starts: dict[str, list[float]] = {}
    ids: dict[str, set[str]] = {}
    for e in records:
        starts.setdefault(e["stream"], []).append(e["t"])
        ids.setdefault(e["stream"], set()).add(e["id"])
    ok = True
    t0 = min(min(ts) for ts in starts.values())
    table = Table(title="Per-window summary (starts per aligned second; worker clocks)")
    table.add_column("stream")
    table.add_column("limit", justify="right")
    table.add_column("starts per second", justify="left")
    table.add_column("max any 1s", justify="right")
    table.add_column("ran once", justify="right")
    table.add_column("re-sends /waiting", justify="right")
    table.add_column("verdict")
    for stream, (limit, window, total) in STREAMS.items():
        ts = sorted(starts.get(stream, []))
        per_second: dict[int, int] = {}
        for t in ts:
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
        bars = " ".join(str(per_second.get(s, 0)) for s in range(max(per_second) + 1))
        peak = max_in_window(ts, window)
        once = len(ids.get(stream, ())) == len(ts) == total
        held = peak <= limit and once
        ok &= held
        waiting = max(total - limit, 1)
        table.add_row(stream, f"{limit}/s", bars, str(peak), f"{len(ids.get(stream, ()))}/{total}",
                      f"{denials.get(stream, 0) / waiting:.2f}",
                      "[green]held[/]" if held else "[red]FAILED[/]")
    console.print(table)
    return ok


def main() -> int:
    url, redis_proc = find_redis()
    prefix = f"throttle-demo-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, DEMO_REDIS_URL=url, DEMO_PREFIX=prefix, PYTHONPATH=str(ROOT))
    os.environ.update(DEMO_REDIS_URL=url, DEMO_PREFIX=prefix)
    client = redis.Redis.from_url(url)
    logdir = Path(tempfile.mkdtemp(prefix="throttle-demo-"))
    console.print(f"Redis: {url}   key prefix: {prefix}   worker logs: {logdir}")
    procs = start_workers(env, logdir)
    try:
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
        with Live(progress_table({}, {}, t0), console=console, refresh_per_second=4) as live:
            while time.time() - t0 < 60:
                starts = read_starts(client, prefix)
                live.update(progress_table(starts, read_denials(client, prefix), t0))
                if sum(map(len, starts.values())) >= expected:
                    break
                time.sleep(0.25)
        time.sleep(1)  # anything running twice would show up now
        ok = summary(read_records(client, prefix), read_denials(client, prefix))
        return 0 if ok else 1
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        if redis_proc is not None:
            redis_proc.terminate()


if __name__ == "__main__":
    sys.exit(main())
