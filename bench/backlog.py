"""Section 9: what a deep line costs.

A key whose quota is spent gathers its waiting tasks in its line: tens of thousands for a
flood. Releasing its head, and claiming what was released, must cost what it costs with
a short line, and the key's window must stay small. Everything here runs on a
redis-server of its own, started on a free loopback port for the section and stopped
after it, so its ``INFO commandstats`` (EVALSHA ``usec`` / ``calls``: script time per
call, in Redis) and its ``SLOWLOG`` are ours to reset and read.

:func:`run_deep_line`: one key of ``20/s`` (sliding, then fixed) with D tasks in its line
(D = 100 … 100 000, each joined by an acquire call with its message, as a worker's), on a
test clock: the script time per task released and claimed (the releaser's call and the
worker's claim), the slowest call, and the bytes the line keeps per waiting task.
(The reservation backlog this section measured before the line, and its peers, are the
previous release's: bench/results.md keeps them.)
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from bench.common import OUT_DIR, Results, fmt_bytes, wait_until
from celery_throttle.core.keys import state_key, window_keys
from celery_throttle.core.protocol import Code, Entry, WindowCall
from celery_throttle.core.rates import parse_rate
from celery_throttle.store.client import RedisStore

SEC = "9 deep line"
ALGORITHMS = ("sliding", "fixed")
#: Tasks released and claimed at each depth (the script time is their mean).
MEASURED = 400
SLOWEST_TARGET_US = 1000
RATIO_TARGET = 1.3
#: A small task's message, as the line keeps it.
MESSAGE = b"x" * 300


# -- the dedicated server ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DedicatedRedis:
    """A throwaway ``redis-server`` on a free loopback port: no persistence, ours alone."""

    def __init__(self, name: str, binary: str = "redis-server") -> None:
        self.name = name
        self.binary = binary
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.client: Any = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self) -> None:
        logdir = OUT_DIR / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.TemporaryDirectory(prefix="ct-bench-redis-")
        for _ in range(3):  # the port may be taken between finding and binding it
            self.port = _free_port()
            log = logdir / f"redis-{self.name}-{self.port}.log"
            cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no"]
            with open(log, "wb") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=120)
            if wait_until(self._up, 10, 0.05) and self.proc.poll() is None:
                self.url = f"redis://127.0.0.1:{self.port}/0"
                return
            self._stop()
        raise RuntimeError(f"could not start redis-server: {Path(log).read_text(errors='replace')[-500:]}")

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            return True  # exited: wait_until stops, the ping below says no
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        self._stop()
        if self._dir is not None:
            self._dir.cleanup()

    def _stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextmanager
def dedicated_redis(name: str, binary: str = "redis-server") -> Iterator[DedicatedRedis]:
    """A started :class:`DedicatedRedis`, stopped on the way out (failures included)."""
    server = DedicatedRedis(name, binary)
    try:
        server.start()
        yield server
    finally:
        server.stop()


# -- reading the server's own figures -----------------------------------------------------
def evalsha_stats(client: Any) -> tuple[int, int]:
    """(calls, µs) of EVALSHA since the last CONFIG RESETSTAT."""
    stat = client.info("commandstats").get("cmdstat_evalsha") or {}
    return int(stat.get("calls", 0)), int(stat.get("usec", 0))


def slowlog_evalsha(client: Any) -> list[tuple[int, int, list[bytes]]]:
    """Every EVALSHA in the SLOWLOG, oldest first: (id, µs, arguments)."""
    out = []
    for entry in client.slowlog_get(-1):
        command = entry["command"]
        if command.startswith(b"EVALSHA "):
            out.append((int(entry["id"]), int(entry["duration"]), command.split(b" ")))
    out.sort()
    return out


class _Clock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def measure_line(url: str, client: Any, prefix: str, algorithm: str, depth: int) -> dict[str, float]:
    """Fill one key's line to ``depth``, then release and claim MEASURED of its tasks."""
    clock = _Clock(1_700_000_000_000_000)
    store = RedisStore(url, prefix, clock=clock)
    call = WindowCall(algorithm, (parse_rate("20/s"),), 1, slack_us=10_000)
    key = state_key(prefix, "deep", f"{algorithm}-{depth}")
    try:
        for n in range(depth + 20):  # (20 fit the window; the rest wait)
            store.acquire(key, call, entry=Entry(f"t{n}", MESSAGE, f"t{n}", 0, 0, 8))
        keys = window_keys(key)
        line_bytes = sum(client.memory_usage(k) or 0 for k in keys[1:5])
        client.config_resetstat()
        client.slowlog_reset()
        released, codes = 0, {}
        measured = min(MEASURED, depth)
        while released < measured:
            reply = store.release(key, call, 64)
            for r in reply.reported:
                got = store.claim(key, call, r.id, early_us=1_000_000, holder=f"h{r.id}")
                codes[got.code] = codes.get(got.code, 0) + 1
                released += 1
            clock.now = max(reply.due_us, clock.now + 1_000) if reply.due_us else clock.now + 50_000
        calls, usec = evalsha_stats(client)
        slowest = max((d for _, d, _ in slowlog_evalsha(client)), default=0)
        window_bytes = client.memory_usage(keys[0]) or 0
        return {"us_per_task": usec / released, "calls_per_task": calls / released, "slowest": slowest,
                "bytes_per_waiting": line_bytes / depth, "window_bytes": window_bytes,
                "all_ran": float(set(codes) <= {Code.RUN, Code.RUN_AT})}
    finally:
        for k in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(k)
        store.close()


def run_deep_line(res: Results, prefix: str, depths: Sequence[int]) -> None:
    """The cost per task released and claimed, the slowest call and the bytes, by depth."""
    with dedicated_redis("deep-line") as red:
        red.client.config_set("slowlog-log-slower-than", 0)
        red.client.config_set("slowlog-max-len", 20000)
        for algorithm in ALGORITHMS:
            runs = [(d, measure_line(red.url, red.client, prefix, algorithm, d)) for d in depths]
            base = runs[0][1]["us_per_task"]
            worst = max(r["us_per_task"] for _, r in runs) / base
            res.add(SEC, "script µs per task released and claimed, by tasks in the line", algorithm,
                    " · ".join(f"{d:,}: {r['us_per_task']:.0f}" for d, r in runs),
                    f"<= {RATIO_TARGET}x depth {depths[0]:,}", worst <= RATIO_TARGET and all(r["all_ran"] for _, r in runs),
                    f"up to {MEASURED} tasks released (batches of 64) and claimed at each depth, script time "
                    "(commandstats); script calls per task: "
                    + " · ".join(f"{r['calls_per_task']:.2f}" for _, r in runs))
            res.add(SEC, "slowest call (µs)", algorithm, " · ".join(f"{d:,}: {r['slowest']:.0f}" for d, r in runs),
                    f"< {SLOWEST_TARGET_US} µs", max(r["slowest"] for _, r in runs) < SLOWEST_TARGET_US,
                    "SLOWLOG of the measured calls (a release call sends up to 64)")
            res.add(SEC, "bytes per waiting task; the window's bytes", algorithm,
                    " · ".join(f"{d:,}: {r['bytes_per_waiting']:.0f} B; {fmt_bytes(int(r['window_bytes']))}"
                               for d, r in runs), "", None,
                    f"MEMORY USAGE of the line's keys over the tasks in it (a message of {len(MESSAGE)} B each)")
