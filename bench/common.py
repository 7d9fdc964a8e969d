"""Shared pieces of the benchmark: where things live, results, window arithmetic.

The bench owns Redis databases 10 (window state, records) and 11 (Celery broker) on the
local server; every key it writes starts with a per-run prefix ``ct-bench-<hex>``.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
OUT_DIR = BENCH_DIR / "out"

REDIS_HOST = "127.0.0.1"
REDIS_PORT = int(os.environ.get("CB_REDIS_PORT", "6379"))
STORE_DB = 10
BROKER_DB = 11
STORE_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/{STORE_DB}"
BROKER_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/{BROKER_DB}"

MET, MISSED, INFO = "met", "missed", "info"


def new_prefix() -> str:
    """A key prefix of this run's own."""
    return f"ct-bench-{uuid.uuid4().hex[:10]}"


def store_client() -> redis.Redis:
    return redis.Redis.from_url(STORE_URL, socket_timeout=30)


def broker_client() -> redis.Redis:
    return redis.Redis.from_url(BROKER_URL, socket_timeout=30)


@dataclass
class Row:
    """One line of the results table."""

    section: str
    metric: str
    variant: str
    value: str
    target: str = ""
    status: str = INFO
    note: str = ""


@dataclass
class Results:
    """Everything a run measured: table rows, free-form notes, series for the chart, and
    tables of a section's own (Markdown, printed and written after the main table)."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)

    def add(self, section: str, metric: str, variant: str, value: str, target: str = "",
            ok: bool | None = None, note: str = "") -> None:
        status = INFO if ok is None else (MET if ok else MISSED)
        self.rows.append(Row(section, metric, variant, value, target, status, note))


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until truthy or ``timeout`` seconds; returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def max_in_window(times: Sequence[float], window: float) -> int:
    """Most starts in any half-open interval ``[t, t + window)``."""
    ts = sorted(times)
    best = 0
    for i, t in enumerate(ts):
        best = max(best, bisect_left(ts, t + window) - i)
    return best


def max_in_aligned(times: Iterable[float], window: float) -> int:
    """Most starts in one aligned window ``[k * window, (k + 1) * window)``."""
    counts: dict[int, int] = {}
    for t in times:
        k = math.floor(t / window)
        counts[k] = counts.get(k, 0) + 1
    return max(counts.values(), default=0)


def ideal_makespan(tasks: int, limit: int, window: float) -> float:
    """Shortest possible first-to-last start of ``tasks`` at ``limit`` per ``window``."""
    return (math.ceil(tasks / limit) - 1) * window


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def fmt_num(x: float, digits: int = 2) -> str:
    if math.isnan(x):
        return "n/a"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def fmt_bytes(n: float) -> str:
    if math.isnan(n):
        return "n/a"
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def used_memory(client: redis.Redis) -> int:
    """Redis ``used_memory`` (the whole server: other users' keys are in it too)."""
    return int(client.info("memory")["used_memory"])


def delete_prefix(client: redis.Redis, prefix: str, limit: int = 5_000_000) -> int:
    """UNLINK every key starting with ``prefix`` (SCAN, bounded); returns how many."""
    n = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*", count=2000):
        batch.append(key)
        if len(batch) >= 1000:
            n += client.unlink(*batch)
            batch.clear()
        if n >= limit:
            break
    if batch:
        n += client.unlink(*batch)
    return n


def limits_peers(url: str, prefix: str) -> list[tuple[str, str, Callable[[], Any]]]:
    """The ``limits`` strategies as peers: (name, algorithm family, one hit that never
    reaches its limit); none when ``limits`` is not installed."""
    try:
        from limits import parse
        from limits.storage import RedisStorage
        from limits.strategies import (
            FixedWindowRateLimiter,
            MovingWindowRateLimiter,
            SlidingWindowCounterRateLimiter,
        )
    except ImportError:
        return []
    storage = RedisStorage(url, key_prefix=f"{prefix}-limits")
    item = parse("1000000/second")
    out: list[tuple[str, str, Callable[[], Any]]] = []
    for name, family, cls in (("limits FixedWindow", "fixed", FixedWindowRateLimiter),
                              ("limits MovingWindow", "sliding", MovingWindowRateLimiter),
                              ("limits SlidingWindowCounter", "sliding", SlidingWindowCounterRateLimiter)):
        limiter = cls(storage)
        ident = name.split()[-1]  # the strategies share key names: one each
        out.append((name, family, lambda lim=limiter, i=ident: lim.hit(item, i)))
    return out


def import_configured(module: str, env: dict[str, str]) -> Any:
    """Import a worker app ``module`` in this process (a producer), with ``env`` set as
    its workers get it, then put the environment back. Finalizes the app, so every
    throttled task is hooked as in a worker."""
    import importlib

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mod = importlib.import_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if any(getattr(mod, name, value) != value for name, value in
           (("PREFIX", env.get("CB_PREFIX")), ("STORE", env.get("CB_STORE")))):
        raise RuntimeError(f"{module} was imported earlier in this process with other settings")
    _ = mod.app.tasks
    return mod
