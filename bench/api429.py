"""Section 11: 429s from a real API that enforces the published limit.

A user protects an API that allows ``10 per 1 second`` per account, enforced server-side:
bench/apiserver.py, Flask + Flask-Limiter behind gunicorn (2 gthread workers x 4
threads, on a free loopback port), its limit in Redis (db 11, keys of this run's own
prefix) so it is global across the gunicorn workers. Three servers:

* ``moving-window``: Flask-Limiter's moving window (at most 10 requests in any second: a
  log of the last 10 accepted requests' times; the 11th is refused unless the 1st is more
  than a second old);
* ``fixed-window``: its fixed window (a counter that starts at a window's first request
  and expires a second later);
* ``moving-window, 0-100 ms network delay``: the moving window, each request held a random
  0 to 100 ms before the limiter sees it: what a remote API adds to loopback's sub-ms path
  (network, TLS, load balancer, queueing in the API), so the gap between two requests at
  the API is not the gap between the tasks' starts (uniform: a spread of 100 ms).

Each answers 200, or 429 with ``Retry-After``. The client is Celery: bench/apiworker.py's
tasks each make one request and, on a 429, retry themselves (``self.retry(countdown=
Retry-After, at least 1 s)``). They differ only in how they limit themselves:
``@throttle("10/s")`` sliding (the published limit, with the default margin of 20 ms),
``@throttle("10/s", margin=m)`` (m = 0: none),
``@throttle("9/s")``, ``@throttle("10/s", algorithm="fixed")``, Celery's
``rate_limit="10/s"``, no limit. The throttle's key is the API account, as the API's limit
is. The producer is bench.apiworker imported in this process (a user's ``apply_async``:
the check at publish happens where the package does one). 2 Celery workers x 2 prefork
processes.

Each run sends a batch of tasks at once on a fresh account (fresh client and server
windows) and waits for every task to get its 200. ``warm``: the workers and the server
have run before, and the account was warmed by 20 tasks (twice the limit) that ended
1.5 s before the batch. ``cold``: a fresh server and fresh workers; the batch is the first
thing they do.

Reported per run: 429s per 100 tasks (server-side count), requests (server-side),
makespan (first send to last 200) / ideal (tasks / 10 s; the fastest possible is about a
second less: 10 start at once), the closest any 11 accepted requests came at the server
(the moving window refuses the 11th within 1 s: above 1 s is the headroom left), whether
every task completed exactly once (each id one 200, none foreign); in the row notes: the
most 200s the server gave in any second, the closest 11 requests the tasks made, and how
long a request took from the task's call to its arrival at the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import requests

from bench.common import (
    BROKER_URL,
    OUT_DIR,
    ROOT,
    STORE_URL,
    Results,
    broker_client,
    delete_prefix,
    import_configured,
    max_in_window,
    percentile,
    store_client,
    wait_until,
)

SEC = "11 API 429s"
APP = "bench.apiworker"
LIMIT = "10 per 1 second"
PER_SECOND = 10
#: Warm-up tasks on the account before a warm batch, and the pause after them (s).
WARM_TASKS = 2 * PER_SECOND
WARM_PAUSE = 1.5
#: Gunicorn: 2 gthread workers x 4 threads.
GUNICORN = ("-w", "2", "-k", "gthread", "--threads", "4")


@dataclass(frozen=True)
class Server:
    key: str
    strategy: str  # Flask-Limiter's
    jitter_ms: int
    title: str


SERVERS = (
    Server("moving", "moving-window", 0, "moving-window server"),
    Server("fixed", "fixed-window", 0, "fixed-window server"),
    Server("jitter", "moving-window", 100, "moving-window server, 0-100 ms network delay"),
)


@dataclass(frozen=True)
class Client:
    name: str
    task: str  # in bench.apiworker
    #: The margin its sliding window gets (None: not a sliding client of the published rate).
    margin: float | None = None
    #: Run whatever margins are asked for (the default's client).
    always: bool = False


CLIENTS = (
    Client('@throttle("10/s") sliding (default margin: 20 ms)', "sliding", 0.02, always=True),
    Client('@throttle("10/s", margin=0)', "margin_0", 0.0),
    Client('@throttle("10/s", margin=0.05)', "margin_05", 0.05),
    Client('@throttle("10/s", margin=0.1)', "margin_10", 0.1),
    Client('@throttle("9/s") sliding', "sliding_9"),
    Client('@throttle("10/s", algorithm="fixed")', "fixed"),
    Client('Celery rate_limit="10/s"', "builtin"),
    Client("no throttle", "plain"),
)
SLIDING = ("sliding", "margin_0", "margin_05", "margin_10")
#: Per server: the clients run warm and cold (None: all). The fixed-window server and the
#: delayed one run fewer, to keep the section near 10 minutes: the delayed server is
#: there for the sliding clients, and the fixed one is more lenient than the moving one
#: (a stream with at most 10 in any second has at most 10 in any of its windows).
WARM = {"moving": None, "fixed": ("sliding", "margin_05", "fixed", "builtin", "plain"), "jitter": SLIDING}
COLD = {"moving": SLIDING, "fixed": ("sliding",), "jitter": ("sliding", "margin_05")}


def plan(margins: Sequence[float], cold: Sequence[str], quick: bool) -> list[tuple[Server, str, list[Client]]]:
    """(server, phase, clients) in the order run; ``cold``: the servers with cold runs."""
    pick = [c for c in CLIENTS if c.margin is None or c.always or c.margin in margins]
    if quick:
        pick = [c for c in pick if c.task != "sliding_9"]
    out = []
    for server in SERVERS:
        if server.key in cold:
            out.append((server, "cold", [c for c in pick if c.task in COLD[server.key]]))
        warm = WARM[server.key]
        out.append((server, "warm", [c for c in pick if warm is None or c.task in warm]))
    return [x for x in out if x[2]]


@dataclass
class Run:
    client: Client
    server: Server
    phase: str  # "warm" or "cold"
    tasks: int
    sent_at: float = 0.0
    ids: list[str] = field(default_factory=list)
    #: (time made, time answered, task id) for each 200.
    done: list[tuple[float, float, str]] = field(default_factory=list)
    #: (time made, status, task id) for each request the tasks made.
    tries: list[tuple[float, int, str]] = field(default_factory=list)
    #: (server arrival time, status, task id) for each request the server answered.
    arrivals: list[tuple[float, int, str]] = field(default_factory=list)
    server_requests: int = 0
    server_429: int = 0
    client_429: int = 0
    failed: int = 0
    complete: bool = False
    waited: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def per100(self) -> float:
        return self.server_429 * 100 / self.tasks

    @property
    def ideal(self) -> float:
        return self.tasks / PER_SECOND

    @property
    def makespan(self) -> float:
        return max((a for _, a, _ in self.done), default=float("nan")) - self.sent_at

    @property
    def once(self) -> tuple[int, int, int]:
        """(distinct ids that got their 200, duplicates, ids not sent)."""
        seen = [i for _, _, i in self.done]
        unique = set(seen)
        return len(unique), len(seen) - len(unique), len(unique - set(self.ids))

    @property
    def exactly_once(self) -> bool:
        unique, dup, foreign = self.once
        return self.complete and unique == self.tasks and dup == 0 and foreign == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiServer:
    """bench/apiserver.py under gunicorn, in a process group of its own."""

    def __init__(self, prefix: str, server: Server) -> None:
        self.prefix = prefix
        self.server = server
        self.strategy = server.strategy
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = OUT_DIR / "logs" / f"api-{server.key}-{uuid.uuid4().hex[:6]}.log"

    def start(self, timeout: float = 60) -> ApiServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(CB_PREFIX=self.prefix, CB_STORE=STORE_URL, CB_API_STORAGE=BROKER_URL,
                   CB_API_KEY_PREFIX=f"{self.prefix}-api", CB_API_STRATEGY=self.strategy,
                   CB_API_JITTER_MS=str(self.server.jitter_ms), CB_API_LIMIT=LIMIT, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "gunicorn", *GUNICORN, "-b", f"127.0.0.1:{self.port}",
               "--log-level", "info", "bench.apiserver:app"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        workers = int(GUNICORN[1])
        if not wait_until(lambda: self._loaded() >= workers, timeout, 0.1):
            raise RuntimeError(f"API server ({self.strategy}) not up in {timeout}s:\n{self.tail()}")
        if requests.get(f"{self.url}/health", timeout=5).status_code != 200:
            raise RuntimeError(f"API server ({self.strategy}) /health failed:\n{self.tail()}")
        return self

    def _loaded(self) -> int:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"API server ({self.strategy}) exited:\n{self.tail()}")
        return self.log.read_bytes().count(b"bench.apiserver loaded in")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def errors(self) -> list[str]:
        return [line.strip()[:300] for line in self.tail(200_000).splitlines()
                if "Traceback" in line or "[ERROR]" in line or "[CRITICAL]" in line]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def producer(prefix: str) -> Any:
    """``bench.apiworker``, imported in this process configured like the workers."""
    return import_configured("bench.apiworker", {
        "CB_PREFIX": prefix, "CB_STORE": STORE_URL, "CB_BROKER": BROKER_URL, "CB_QUEUE": f"{prefix}-api-idle"})


def _read(prefix: str, label: str) -> dict[str, Any]:
    store = store_client()
    pipe = store.pipeline(transaction=False)
    for what in ("done", "try", "arr"):
        pipe.lrange(f"{prefix}:api:{what}:{label}", 0, -1)
    for what in ("req", "429", "c429", "err"):
        pipe.get(f"{prefix}:api:{what}:{label}")
    done, tries, arr, req, n429, c429, err = pipe.execute()

    def rows(raw: list[bytes]) -> list[tuple[str, ...]]:
        return [tuple(x.decode().split()) for x in raw]

    return {"done": [(float(a), float(b), i) for a, b, i in rows(done)],
            "tries": [(float(t), int(s), i) for t, s, i in rows(tries)],
            "arrivals": [(float(t), int(s), i) for t, s, i in rows(arr)],
            "req": int(req or 0), "429": int(n429 or 0), "c429": int(c429 or 0), "err": int(err or 0)}


def _send(wa: Any, task: str, label: str, account: str, queue: str, count: int) -> list[str]:
    fn = getattr(wa, task)
    ids = []
    with wa.app.producer_or_acquire() as pub:
        for _ in range(count):
            ids.append(fn.apply_async((label, account), queue=queue, producer=pub).id)
    return ids


def _done_count(prefix: str, label: str) -> int:
    return int(store_client().llen(f"{prefix}:api:done:{label}"))


def run_batch(wa: Any, prefix: str, queue: str, client: Client, server: Server, phase: str,
              tasks: int, settle: float = 0.5) -> Run:
    label = f"api-{server.key}-{client.task}-{phase}-{uuid.uuid4().hex[:4]}"
    account = label  # a fresh account: fresh windows, client and server side
    if phase == "warm":
        warm = f"{label}-warmup"
        _send(wa, client.task, warm, account, queue, WARM_TASKS)
        if not wait_until(lambda: _done_count(prefix, warm) >= WARM_TASKS, 60, 0.1):
            raise RuntimeError(f"warm-up of {client.name} ({server.title}) did not finish in 60s")
        time.sleep(WARM_PAUSE)
    run = Run(client, server, phase, tasks, sent_at=time.time())
    run.ids = _send(wa, client.task, label, account, queue, tasks)
    timeout = run.ideal * 3 + 30
    run.complete = bool(wait_until(lambda: _done_count(prefix, label) >= tasks, timeout, 0.1))
    run.waited = time.time() - run.sent_at
    time.sleep(settle)  # a late duplicate would show now
    got = _read(prefix, label)
    run.done, run.tries, run.arrivals = got["done"], got["tries"], got["arrivals"]
    run.server_requests, run.server_429, run.client_429, run.failed = got["req"], got["429"], got["c429"], got["err"]
    return run


def _clear_queue(queue: str) -> None:
    broker_client().unlink(queue, "unacked", "unacked_index", "unacked_mutex")


def _start(prefix: str, name: str, server: Server) -> tuple[ApiServer, Any]:
    from bench.workers import WorkerGroup

    api = ApiServer(prefix, server).start()
    group = WorkerGroup(prefix, name, env={"CB_API_URL": api.url}, app=APP)
    try:
        group.start()
    except BaseException:
        group.stop()
        api.stop()
        raise
    return api, group


def _stop(api: ApiServer | None, group: Any, runs: Sequence[Run]) -> None:
    errors = []
    if group is not None:
        errors += group.errors()
        group.stop()
        _clear_queue(group.queue)
    if api is not None:
        errors += api.errors()
        api.stop()
    for run in runs:
        run.errors = errors


def run_api429(res: Results, prefix: str, tasks: int, margins: Sequence[float],
               cold: Sequence[str], quick: bool) -> None:
    """``margins``: the margin clients to run; ``cold``: the servers (keys of SERVERS) that
    also get cold runs."""
    wa = producer(prefix)
    runs: list[Run] = []
    started = time.time()

    def say(client: Client, server: Server, phase: str) -> None:
        print(f"api429 [{time.time() - started:.0f}s]: {client.name} vs {server.title}, {phase}, "
              f"{tasks} tasks ...", flush=True)

    try:
        for server, phase, clients in plan(margins, cold, quick):
            if phase == "cold":  # a fresh server and fresh workers for each client
                for client in clients:
                    say(client, server, phase)
                    api = group = None
                    batch: list[Run] = []
                    try:
                        api, group = _start(prefix, f"api-cold-{server.key}-{client.task}", server)
                        batch.append(run_batch(wa, prefix, group.queue, client, server, phase, tasks))
                    finally:
                        _stop(api, group, batch)
                    runs += batch
                continue
            api = group = None
            batch = []
            try:
                api, group = _start(prefix, f"api-warm-{server.key}", server)
                for client in clients:
                    say(client, server, phase)
                    batch.append(run_batch(wa, prefix, group.queue, client, server, phase, tasks))
            finally:
                _stop(api, group, batch)
            runs += batch
    finally:
        wa.ctl.store.close()
        wa.app.close()
        delete_prefix(broker_client(), f"{prefix}-api")  # the API's limiter keys
        delete_prefix(store_client(), f"{prefix}:api:")
    _report(res, runs, tasks, time.time() - started)


def _delays(run: Run) -> list[float]:
    """Seconds from each request's making (in the task) to its arrival at the server."""
    made: dict[str, list[float]] = {}
    for t, _, i in run.tries:
        made.setdefault(i, []).append(t)
    came: dict[str, list[float]] = {}
    for t, _, i in run.arrivals:
        came.setdefault(i, []).append(t)
    out = []
    for i, ts in made.items():
        out += [b - a for a, b in zip(sorted(ts), sorted(came.get(i, [])))]
    return sorted(out)


def closest(times: Sequence[float], n: int = PER_SECOND + 1) -> float:
    """The shortest time spanned by any ``n`` consecutive times (nan if fewer)."""
    ts = sorted(times)
    return min((ts[i + n - 1] - ts[i] for i in range(len(ts) - n + 1)), default=float("nan"))


def _accepted(run: Run) -> list[float]:
    return [t for t, s, _ in run.arrivals if s == 200]


def _report(res: Results, runs: list[Run], tasks: int, elapsed: float) -> None:
    for run in runs:
        margin = run.client.margin is not None
        target = run.server.key == "moving" and margin
        ok200 = max_in_window(_accepted(run), 1.0)
        delays = _delays(run)
        unique, dup, foreign = run.once
        dmax = delays[-1] * 1000 if delays else float("nan")
        note = (f"{run.server_requests} requests ({run.server_requests / run.tasks:.2f}/task), "
                f"the tasks saw {run.client_429} 429s; makespan {run.makespan:.1f}s vs ideal {run.ideal:.0f}s "
                f"= {run.makespan / run.ideal:.2f}; closest 11 accepted at the server "
                f"{closest(_accepted(run)):.3f}s, closest 11 made by the tasks "
                f"{closest([t for t, _, _ in run.tries]):.3f}s; most 200s in any 1 s at the server {ok200}; "
                f"request made -> server arrival p50 {percentile(delays, 0.5) * 1000:.1f} ms, max {dmax:.1f} ms; "
                f"each once: {unique}/{run.tasks}, {dup} dup, {foreign} foreign")
        if run.failed:
            note += f"; {run.failed} failed requests"
        res.add(SEC, f"429s per 100 tasks, {run.server.title}, {run.phase}", run.client.name,
                f"{run.per100:.1f}", "0" if target else "", (run.server_429 == 0) if target else None, note)
    bad = [r for r in runs if not r.exactly_once]
    res.add(SEC, "every task completed exactly once", "all runs", f"{len(runs) - len(bad)}/{len(runs)} runs",
            "all", not bad, "; ".join(f"{r.client.name} {r.server.key} {r.phase}: {r.once} of {r.tasks} "
                                      f"in {r.waited:.0f}s" for r in bad)[:600])
    for server in SERVERS:
        mine = [r for r in runs if r.server == server and r.client.task in SLIDING]
        if not mine:
            continue
        zero = None
        for c in sorted({r.client for r in mine}, key=lambda c: c.margin or 0.0):
            if all(r.server_429 == 0 for r in mine if r.client == c):
                zero = c
                break
        tried = sorted({r.client.margin or 0.0 for r in mine})
        least = []
        for m in tried:
            spans = [closest(_accepted(r)) for r in mine if (r.client.margin or 0.0) == m]
            least.append(f"{m:g}: {(min(spans) - 1) * 1000:.0f} ms")
        res.add(SEC, f"smallest margin with 0 429s, {server.title} (every run)", "sliding 10/s",
                "none" if zero is None else f"{zero.margin or 0:g} s", "", None,
                f"margins tried (s): {', '.join(f'{m:g}' for m in tried)}; runs: {len(mine)}; least headroom "
                f"at the server (closest 11 accepted - 1 s) by margin: {', '.join(least)}")
    for phase in ("cold", "warm"):
        pair = [[r.makespan for r in runs if r.server.key == "moving" and r.phase == phase and r.client.task == t]
                for t in ("sliding", "margin_0")]
        if all(pair):
            ratio = (sum(pair[0]) / len(pair[0])) / (sum(pair[1]) / len(pair[1]))
            res.add(SEC, f"makespan of the default margin / margin=0, moving-window server, {phase}", "sliding 10/s",
                    f"{ratio:.3f}", "<= 1.03", ratio <= 1.03,
                    f"{pair[0][0]:.2f}s vs {pair[1][0]:.2f}s (one run each, side by side)")
    res.tables.append(_pivot(runs, tasks, elapsed))
    errors = sorted({e for r in runs for e in r.errors})
    if errors:
        res.notes.append(f"API 429s: worker or server log errors ({len(errors)}): " + " | ".join(errors[:5]))
    res.notes.append(
        f"API 429s: Flask-Limiter {LIMIT} per account (moving-window and fixed-window strategies, Redis "
        "storage) under gunicorn, 2 gthread workers x 4 threads; tasks retry a 429 with self.retry("
        f"countdown=Retry-After, at least 1 s); batches of {tasks} tasks at once on a fresh account; "
        f"warm = workers and server running, the account warmed by {WARM_TASKS} tasks ending "
        f"{WARM_PAUSE:g}s before; cold = fresh server and workers. Makespan = first send to last 200, "
        f"ideal = tasks / 10 s (the fastest possible is {(tasks - PER_SECOND) / tasks:.2f} of it). "
        "'Closest 11': the shortest span of any 11 accepted requests at the server (by the time the "
        "request reached the app, just before the limiter): the moving window refuses the 11th within 1 s.")


def _pivot(runs: list[Run], tasks: int, elapsed: float) -> str:
    """One line per client and phase: the issue's table."""
    keys = [s.key for s in SERVERS]
    head = (f"API 429s ({tasks} tasks per run, {elapsed:.0f} s):\n\n"
            "| client | run | 429s per 100 tasks, moving-window server | fixed-window server "
            "| moving-window, 0-100 ms network delay | makespan / ideal (moving / fixed / delay) "
            "| requests (moving / fixed / delay) | closest 11 at the server, s (moving / fixed / delay) "
            "| each task once |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    order = [c for c in CLIENTS if any(r.client == c for r in runs)]
    for phase in ("warm", "cold"):
        for client in order:
            by = {r.server.key: r for r in runs if r.client == client and r.phase == phase}
            if not by:
                continue

            def cells(fmt: Any, by: dict[str, Run] = by) -> list[str]:
                return [fmt(by[k]) if k in by else "-" for k in keys]

            per100 = cells(lambda r: f"{r.per100:.1f}")
            span = " / ".join(cells(lambda r: f"{r.makespan / r.ideal:.2f}"))
            reqs = " / ".join(cells(lambda r: f"{r.server_requests}"))
            near = " / ".join(cells(lambda r: f"{closest(_accepted(r)):.3f}"))
            once = "yes" if all(r.exactly_once for r in by.values()) else "NO"
            lines.append(f"| {client.name} | {phase} | {' | '.join(per100)} | {span} | {reqs} | {near} | {once} |")
    return "\n".join(lines)
