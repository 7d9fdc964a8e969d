"""What the sections share: results, workers of bench/app.py (tests/harness.py's AppWorkers), its
producer, a server's own counts, the fake APIs' HTTP server. Each section runs on redis-servers of
its own (tests/harness.py's ``redis_server``): db 0 the store and the notes, db 1 the broker, unless said.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import astuple, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import redis

from tests.harness import AppWorkers, redis_server, waited

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
OUT = BENCH / "out"
MET, MISSED, INFO = "met", "missed", "info"


@dataclass
class Row:
    section: str
    metric: str
    variant: str
    value: str
    target: str = ""
    status: str = INFO
    note: str = ""


@dataclass
class Results:
    """Rows, notes, each section's Markdown tables, series (bench/out/results.json) and the
    headline table's cells (row -> column -> text)."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tables: dict[str, list[str]] = field(default_factory=dict)
    series: dict[str, Any] = field(default_factory=dict)
    headline: dict[str, dict[str, str]] = field(default_factory=dict)

    def add(self, section: str, metric: str, variant: str, value: str, target: str = "",
            ok: bool | None = None, note: str = "", judged: bool = True) -> None:
        """A row; not ``judged`` (a peer's, a variant without the target): no target, no status."""
        status = INFO if ok is None or not judged else MET if ok else MISSED
        self.rows.append(Row(section, metric, variant, value, target if judged else "", status, note))

    def table(self, section: str, text: str) -> None:
        self.tables.setdefault(section, []).append(text)

    def cell(self, row: str, column: str, text: str) -> None:
        self.headline.setdefault(row, {})[column] = text

    def errors(self, what: str, errors: Sequence[str]) -> None:
        """A note of the first worker log errors of ``what``, if any."""
        if errors:
            self.notes.append(f"{what}: worker log errors: " + " | ".join(errors[:3]))


def md(head: str, rows: Iterable[str]) -> str:
    """A Markdown table: ``head`` its header row (``| a | b |``), then ``rows``."""
    return "\n".join([head, "|---" * (head.count("|") - 1) + "|", *rows])


def yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else math.nan


def most_at_once(spans: Iterable[Sequence[Any]]) -> int:
    """The most of ``spans`` (``(start, end, ...)``) running at once."""
    running = most = 0
    for _, step in sorted(x for s in spans for x in ((s[0], 1), (s[1], -1))):
        running += step
        most = max(most, running)
    return most


def new_prefix(name: str = "") -> str:
    return f"ct-bench-{name}{'-' if name else ''}{uuid.uuid4().hex[:8]}"


class Workers(AppWorkers):
    """tests/harness.py's AppWorkers, reading the lists of spans (``<prefix>:<name>``) the slot tasks note."""

    def noted(self, name: str) -> list[list[str]]:
        """The notes' list ``<prefix>:<name>`` (``spans``, ``began``), each entry split on spaces."""
        return [x.decode().split() for x in self.records.lrange(f"{self.prefix}:{name}", 0, -1)]

    def await_noted(self, name: str, count: int, timeout: float, interval: float = 0.1) -> None:
        """Wait for ``count`` entries in ``<prefix>:<name>``; raise if they do not come."""
        key = f"{self.prefix}:{name}"
        if not waited(lambda: self.records.llen(key) >= count, timeout, interval):
            raise RuntimeError(f"{self.records.llen(key)} of {count} {name} within {timeout:.0f} s")


@contextmanager
def running(prefix: str, server: Any = None, start: bool = True, *, store: str = "", broker: str = "",
            records: str | None = None, **options: Any) -> Iterator[Workers]:
    """Workers of bench/app.py (2 x 2 prefork unless said) on ``server``'s store and broker,
    started (unless not ``start``), and stopped after the block."""
    if server is not None:
        store, broker = store or server.url, broker or f"redis://127.0.0.1:{server.port}/1"  # (db 1: the broker)
    group = Workers("bench.app", prefix, broker, store, records=records, logs_to=OUT / "logs", **options)
    try:
        if start:
            group.start()
        yield group
    finally:
        group.stop()


@contextmanager
def served(name: str, one_db: bool = False, apart: bool = False, **options: Any) -> Iterator[tuple[Any, Workers]]:
    """:func:`running` workers on a redis-server of their own (``one_db``: the broker on db 0 too); ``apart``:
    the store on another, alone (its counts the throttle's). Yields (the store's server, the workers)."""
    with (redis_server() as server, (redis_server() if apart else nullcontext(server)) as store,
          running(new_prefix(name), server, store=store.url, broker=server.url if one_db else "", records=server.url,
                  **options) as group):
        yield store, group


def produce(group: AppWorkers, *sends: dict[str, Any]) -> list[dict[str, Any]]:
    """bench/app.py's producer, a process of its own with the workers' settings: what it reports of each send."""
    done = subprocess.run([sys.executable, "-m", "bench.app", "-"], input=json.dumps({"sends": list(sends)}), cwd=ROOT,
                          env=group._environ(), capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode:
        raise RuntimeError(f"the producer failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1])["sends"])


def after_send(sent: Sequence[dict[str, Any]], starts: Iterable[tuple[str, float]]) -> list[float]:
    """Each start's seconds after its send, sorted: ``sent`` the producer's reports (with ``ids``),
    ``starts`` (task id, start time)."""
    at = {i: t for send in sent for i, t in zip(send["ids"], send["times"])}
    return sorted(t - at[i] for i, t in starts if i in at)


def spend(store: str, prefix: str, scope: str, keys: Sequence[str], rate: str) -> None:
    """Spend each key's quota ``rate`` of ``scope``, as a call of the whole quota would."""
    from celery import Celery

    from celery_throttle import Throttle
    from celery_throttle.core.rates import parse_rate

    ctl = Throttle(Celery("bench-spend", broker="memory://", set_as_current=False),
                   {"redis_url": store, "key_prefix": prefix})
    try:
        for key in keys:
            if not ctl.acquire(scope, key=key, rates=rate, cost=parse_rate(rate).limit).allowed:
                raise RuntimeError(f"could not spend {scope} {key}'s quota")
    finally:
        ctl.close()


def standalone(module: str, argv: list[str] | None, scale: Any, keep: bool, *parts: tuple[Any, ...]) -> None:
    """``python -m <module> [argv]`` (default: sys.argv's): each ``(title, run, *args)`` a section, then the run
    written."""
    from bench.__main__ import finish, section

    res, started = Results(), time.time()
    for title, run, *args in parts:
        section(res, title, run, scale, *args)
    command = " ".join(["python -m", module, *(sys.argv[1:] if argv is None else argv)])
    finish(res, command, time.time() - started, keep)


@dataclass
class Counts:
    """A redis-server's own counts: script calls and their µs, every command, its CPU (s)."""

    script_calls: int = 0
    script_us: int = 0
    commands: int = 0
    cpu_s: float = 0.0

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(a - b for a, b in zip(astuple(self), astuple(other))))


def counts(client: redis.Redis) -> Counts:
    stats, cpu = client.info("commandstats"), client.info("cpu")
    scripts = [stats.get(f"cmdstat_{name}") or {} for name in ("evalsha", "eval", "evalsha_ro", "eval_ro")]
    return Counts(sum(int(s.get("calls", 0)) for s in scripts), sum(int(s.get("usec", 0)) for s in scripts),
                  sum(int(v.get("calls", 0)) for v in stats.values() if isinstance(v, dict)),
                  float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))


@dataclass
class Arrival:
    """A request as the API saw it: when, its answer, its task, its tokens, when it was answered."""

    at: float
    status: int
    task_id: str
    tokens: int = 0
    answered: float = 0.0


#: ``decide(path, query)`` -> (status, tokens, Retry-After s (None: no header), seconds before a 200
#: is sent[, the reply's own headers]).
Decide = Callable[[str, dict[str, str]], tuple[Any, ...]]


class Api:
    """A fake API: a stdlib HTTP server on a loopback port, in a thread of the bench's process
    (its limits exact and global, its counts read without a store). Requests are tallied by
    their ``label``; a refusal carries ``Retry-After`` (whole seconds) unless ``decide`` gives None."""

    def __init__(self, decide: Decide) -> None:
        self.lock = threading.Lock()
        self.tallies: dict[str, list[Arrival]] = {}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # (http.server's name)
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                status, tokens, retry, latency, *said = decide(url.path, q)
                arrival = Arrival(time.time(), status, q.get("id", "-"), tokens)
                with api.lock:
                    api.tallies.setdefault(q.get("label", "-"), []).append(arrival)
                if status == 200:
                    time.sleep(latency)
                body = json.dumps({"tokens": tokens}).encode()
                self.send_response(status)
                for name, value in (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                    *([("Retry-After", str(max(0, math.ceil(retry))))] if status != 200 and retry is not None
                                      else []),
                                    *(said[0].items() if said else ())):
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)
                arrival.answered = time.time() if status == 200 else 0.0

            def log_message(self, format: str, *args: object) -> None:  # (http.server's names)
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def tally(self, label: str) -> list[Arrival]:
        with self.lock:
            return list(self.tallies.get(label, []))

    def answered(self, label: str) -> set[str]:
        """Task ids that got their 200."""
        return {a.task_id for a in self.tally(label) if a.answered}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
