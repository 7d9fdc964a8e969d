"""Section 12: what each task costs Redis, end to end, from usual producers.

Every run has a redis-server of its own (a free loopback port, no persistence), which is
the broker AND the throttle store, as for most users; it is started for the run and
stopped after it, so its ``INFO commandstats`` and ``INFO cpu`` are the run's alone. The
tasks are those of ``bench.rpt_app``, a module written as an application writes one
(``install(app)``, ``@app.task`` over ``@throttle``). The producer is a separate process
that only imports that module and calls ``.delay()`` (``bench.rpt_producer``): it never
finalizes the app and never uses ``send_task``. One worker, 2 prefork processes
(``celery -A bench.rpt_app worker -c 2 -P prefork``), started before the producer.

Per-task rows, at each size N (tasks spread over 10 tenants, key ``{tenant}``):

* under the limit (``1000000/s``): plain Celery (no throttle); ours with the check at
  publish on (the default) and off (``throttle_check_at_publish = False`` in producer and
  worker); ``limits``' moving window called by hand in the task (the peer);
* a flood over it: each tenant's ``100/h`` quota spent before the run, so every task is
  turned away: ours reserves a start an hour on and parks the task in Redis; the peer
  retries itself with a countdown to the window's reset (the message waits in the
  worker's memory). Plain Celery has no quota: its under-limit figure is the reference.

Measured from the producer's start until every task ran (under the limit: the queue and
the broker's unacked hash empty) or was turned away (the flood: every task parked, or
held for its countdown): EVALSHA + EVAL calls and their µs (``INFO commandstats``), and
the server's CPU (``used_cpu_user + used_cpu_sys``), per task, with the ratio of CPU to
plain Celery's. The bench polls the server every 0.2 s for the end (a pipeline of 4 reads),
and each worker's releaser looks for due parked tasks once a second: both are in the
figures, as a few calls a second, not per task.

Noisy neighbour, prefilled queue: tenant A (quota ``100/h``, spent) sends N tasks while no
worker runs, then tenant B (quota untouched) sends 10, both from usual producers; then the
first worker starts. B's start latency is counted from the moment that worker is ready
(its ``worker_ready`` signal); every B task must run exactly once.

Learning: 20 tasks of one key (``10/s``) sent 60 s before the first worker starts; once
it is up and they have run, 3 bursts of 10 fresh tasks of the same key, 2 s apart, and
the same on a key never seen before: start latency from each ``.delay()``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from bench.backlog import DedicatedRedis
from bench.common import ROOT, Results, new_prefix, percentile, wait_until
from celery_throttle.core.keys import line_index_key, parking_keys, window_keys

SEC = "12 Redis per task"
APP = "bench.rpt_app"
TENANTS = tuple(f"t{i}" for i in range(10))
QUOTA = "100/h"
LIMITS_QUOTA = "100/hour"  # (as bench.rpt_app has it, for limits; not imported: it makes an app)
B_TASKS = 10
B_TARGET = 1.0
CALLS_TARGET = 0.5
CPU_TARGET = 1.3
LEARN_EARLY = 20
LEARN_AHEAD = 60.0
LEARN_BURST, LEARN_BURSTS, LEARN_GAP = 10, 3, 2.0
#: How often the bench polls the server for the end of a run.
POLL = 0.2


@dataclass(frozen=True)
class Variant:
    name: str
    task: str  # in bench.rpt_app
    check: str | None = None  # CB_CHECK_AT_PUBLISH: "1", "0", None (not throttled)
    flood: bool = False
    peer: bool = False

    @property
    def slug(self) -> str:
        return self.task + ("" if self.check is None else f"-{self.check}")


PLAIN = Variant("plain Celery", "plain")
ABOVE = ", @throttle above @app.task"
UNDER = (PLAIN,
         Variant("ours, check at publish on", "ours_under", "1"),
         Variant("ours, check at publish off", "ours_under", "0"),
         Variant("ours, check at publish on" + ABOVE, "ours_under_above", "1"),
         Variant("limits MovingWindow by hand", "peer_under", peer=True))
FLOOD = (Variant("ours, check at publish on", "ours_flood", "1", flood=True),
         Variant("ours, check at publish off", "ours_flood", "0", flood=True),
         Variant("ours, check at publish on" + ABOVE, "ours_flood_above", "1", flood=True),
         Variant("limits MovingWindow by hand", "peer_flood", flood=True, peer=True))


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    #: Which (set, variant name) run at the largest size; the others stop below it.
    big: tuple[tuple[str, str], ...]
    #: Neighbour floods: (check at publish "1"/"0", flood, task).
    neighbour: tuple[tuple[str, int, str], ...]
    #: The learning rows, per task.
    learn: tuple[str, ...] = ("learn", "learn_above")


FULL = Plan((1000, 10_000, 100_000),
            big=(("under", "plain Celery"), ("under", "ours, check at publish on"),
                 ("under", "ours, check at publish off"), ("flood", "ours, check at publish on")),
            neighbour=(("1", 10_000, "neighbour"), ("0", 10_000, "neighbour"), ("1", 100_000, "neighbour"),
                       ("1", 10_000, "neighbour_above"), ("1", 10_000, "neighbour_unbound"),
                       ("1", 100_000, "neighbour_unbound")),
            learn=("learn", "learn_unbound"))
QUICK = Plan((1000,), big=(), neighbour=(("1", 1000, "neighbour"), ("0", 1000, "neighbour"),
                                         ("1", 1000, "neighbour_above")))


def redis_binary() -> str:
    """The newest redis-server found (PATH first, then the system's), or CB_REDIS_SERVER."""
    if os.environ.get("CB_REDIS_SERVER"):
        return os.environ["CB_REDIS_SERVER"]
    found = []
    for path in (shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if path and os.path.exists(path):
            try:
                out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10,
                                     check=False).stdout
                version = out.split("v=", 1)[1].split()[0]
                found.append((tuple(int(x) for x in version.split(".")), path))
            except (OSError, IndexError, ValueError, subprocess.SubprocessError):
                continue
    if not found:
        raise RuntimeError("no redis-server found")
    return max(found)[1]


# -- the server's figures ---------------------------------------------------------------
@dataclass
class Stats:
    script_calls: int = 0
    script_us: int = 0
    cpu_s: float = 0.0
    commands: int = 0

    def __sub__(self, other: Stats) -> Stats:
        return Stats(self.script_calls - other.script_calls, self.script_us - other.script_us,
                     self.cpu_s - other.cpu_s, self.commands - other.commands)


def snapshot(client: redis.Redis) -> Stats:
    cs = client.info("commandstats")
    cpu = client.info("cpu")
    scripts = [cs.get(k) or {} for k in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro",
                                         "cmdstat_eval_ro")]
    return Stats(sum(int(s.get("calls", 0)) for s in scripts), sum(int(s.get("usec", 0)) for s in scripts),
                 float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                 sum(int(v.get("calls", 0)) for v in cs.values() if isinstance(v, dict)))


# -- processes ---------------------------------------------------------------------------
def _env(server: DedicatedRedis, prefix: str, queue: str, check: str | None) -> dict[str, str]:
    env = {"CB_BROKER": server.url, "CB_PREFIX": prefix, "CB_QUEUE": queue}
    if check is not None:
        env["CB_CHECK_AT_PUBLISH"] = check
    return env


def produce(env: dict[str, str], task: str, count: int, tenants: Sequence[str], *, ids: bool = False,
            bursts: int = 1, gap: float = 0.0, timeout: float = 1800) -> dict[str, Any]:
    """Run a usual producer (bench/rpt_producer.py) to its end; its JSON report."""
    full = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    cmd = [sys.executable, "-m", "bench.rpt_producer", task, str(count), ",".join(tenants),
           "--bursts", str(bursts), "--gap", str(gap)] + (["--ids"] if ids else [])
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"producer {task} failed ({out.returncode}): {out.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    report["process_s"] = time.time() - t0
    report["stderr"] = out.stderr
    return report


def worker(prefix: str, name: str, env: dict[str, str]) -> Any:
    from bench.workers import WorkerGroup

    group = WorkerGroup(prefix, name, count=1, concurrency=2, env=env, app=APP)
    group.queue = env["CB_QUEUE"]
    return group


def _spend(server: DedicatedRedis, prefix: str, task: str, tenants: Sequence[str], peer: bool) -> None:
    """Spend each tenant's quota, as ours or as the peer stores it."""
    from limits import parse

    quota = int(QUOTA.split("/")[0])
    if peer:
        from limits.storage import RedisStorage
        from limits.strategies import MovingWindowRateLimiter

        limiter = MovingWindowRateLimiter(RedisStorage(server.url, key_prefix=f"{prefix}-limits"))
        for t in tenants:
            if not limiter.hit(parse(LIMITS_QUOTA), t, cost=quota):
                raise RuntimeError(f"could not spend {t}'s quota (limits)")
        return
    from celery import Celery

    import celery_throttle

    app = Celery("rpt-spend", broker=server.url, set_as_current=False)
    app.conf.throttle_key_prefix = prefix
    ctl = celery_throttle.install(app)
    try:
        for t in tenants:
            spent = ctl.acquire(f"{APP}.{task}", key=t, rates=QUOTA, cost=quota)
            if not spent.allowed:
                raise RuntimeError(f"could not spend {t}'s quota: {spent}")
    finally:
        ctl.store.close()
        ctl.quick_store.close()
        app.close()


# -- per task ----------------------------------------------------------------------------
@dataclass
class Run:
    variant: Variant
    tasks: int
    stats: Stats = field(default_factory=Stats)
    publish_s: float = float("nan")
    total_s: float = float("nan")
    done: bool = False
    #: What the end looked like: queue, unacked, parked.
    end: tuple[int, int, int] = (0, 0, 0)
    ran: int | None = None
    #: The server's CPU (s/s) before the producer started, the worker up and idle.
    idle: float = float("nan")
    error: str = ""
    errors: list[str] = field(default_factory=list)

    def per_task(self, value: float) -> float:
        return value / self.tasks if self.tasks else float("nan")


def _end_state(client: redis.Redis, queue: str, prefix: str) -> tuple[int, int, int]:
    """(queue, unacked, turned away): tasks waiting in their keys' lines (found through
    the index of keys with a line), and any an earlier version parked."""
    due, _, inflight = parking_keys(prefix)
    pipe = client.pipeline(transaction=False)
    pipe.llen(queue)
    pipe.hlen("unacked")
    pipe.zcard(due)
    pipe.zcard(inflight)
    pipe.zrange(line_index_key(prefix), 0, -1)
    q, unacked, parked, held, keys = pipe.execute()
    waiting = 0
    if keys:
        lines = client.pipeline(transaction=False)
        for key in keys:
            lines.zcard(window_keys(key.decode())[2])
        waiting = sum(lines.execute())
    return int(q), int(unacked), int(parked) + int(held) + waiting


def _finished(variant: Variant, n: int, state: tuple[int, int, int]) -> bool:
    queue, unacked, parked = state
    if queue:
        return False
    if not variant.flood:
        return unacked == 0
    if variant.peer:
        return unacked >= n  # every task back as a message waiting for its countdown
    return unacked == 0 and parked >= n


def run_per_task(binary: str, variant: Variant, n: int) -> Run:
    run = Run(variant, n)
    prefix = new_prefix()
    queue = f"{prefix}-q"
    server = DedicatedRedis(f"rpt-{variant.slug}-{n}", binary)
    group = None
    try:
        server.start()
        client = server.client
        env = _env(server, prefix, queue, variant.check)
        group = worker(prefix, f"rpt-{variant.slug}-{n}", env)
        group.start()
        if variant.flood:
            _spend(server, prefix, variant.task, TENANTS, variant.peer)
        time.sleep(1.0)  # the worker's start-up traffic is over
        quiet = snapshot(client)
        time.sleep(2.0)
        before = snapshot(client)
        run.idle = (before.cpu_s - quiet.cpu_s) / 2.0
        t0 = time.time()
        report = produce(env, variant.task, n, TENANTS)
        run.publish_s = report["last"] - report["first"]
        deadline = time.monotonic() + 120 + n / 100
        state = _end_state(client, queue, prefix)
        while not _finished(variant, n, state) and time.monotonic() < deadline:
            time.sleep(POLL)
            state = _end_state(client, queue, prefix)
        run.done = _finished(variant, n, state)
        if run.done and not variant.flood:
            time.sleep(0.5)  # the last prefetched tasks finish
        run.total_s = time.time() - t0
        run.stats = snapshot(client) - before
        run.end = _end_state(client, queue, prefix)
        run.ran = _accepted(server.url, f"{APP}.{variant.task}")
        run.errors = group.errors()
    except Exception as exc:  # noqa: BLE001 - a failed run is a row, the section goes on
        run.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if group is not None:
            group.stop()
        server.stop()
    return run


def _accepted(url: str, task: str) -> int | None:
    """How many executions of ``task`` the worker's pool accepted (``inspect stats``)."""
    from celery import Celery

    app = Celery("rpt-inspect", broker=url, set_as_current=False)
    try:
        stats = app.control.inspect(timeout=3).stats() or {}
        return sum(int((s.get("total") or {}).get(task, 0)) for s in stats.values())
    except Exception:  # noqa: BLE001 - no reply: unknown
        return None
    finally:
        app.close()


# -- noisy neighbour, prefilled ------------------------------------------------------------
@dataclass
class Neighbour:
    check: str
    flood: int
    task: str = "neighbour"
    publish_s: float = float("nan")
    b_latency: list[float] = field(default_factory=list)
    b_runs: Counter[str] = field(default_factory=Counter)
    b_sent: int = 0
    a_started: int = 0
    a_parked_at_publish: int = 0
    #: Script calls while A's and B's producers ran (no worker yet): the checks at publish.
    publish_calls: int = 0
    a_parked: int = 0
    a_done_s: float = float("nan")
    stats: Stats = field(default_factory=Stats)
    error: str = ""
    errors: list[str] = field(default_factory=list)


def _starts(client: redis.Redis, prefix: str, tenant: str) -> list[tuple[float, str]]:
    out = []
    for item in client.lrange(f"{prefix}:starts:{tenant}", 0, -1):
        t, _, task_id = item.decode().partition(" ")
        out.append((float(t), task_id))
    return out


def run_neighbour_prefilled(binary: str, check: str, flood: int, task: str = "neighbour") -> Neighbour:
    res = Neighbour(check, flood, task)
    prefix = new_prefix()
    queue = f"{prefix}-q"
    server = DedicatedRedis(f"rpt-nb-{task}-{check}-{flood}", binary)
    group = None
    try:
        server.start()
        client = server.client
        env = _env(server, prefix, queue, check)
        _spend(server, prefix, task, ("A",), peer=False)
        before = snapshot(client)
        a = produce(env, task, flood, ("A",))
        res.publish_s = a["last"] - a["first"]
        res.a_parked_at_publish = _end_state(client, queue, prefix)[2]
        b = produce(env, task, B_TASKS, ("B",), ids=True)
        sent = b["ids"]
        res.b_sent = len(sent)
        res.publish_calls = (snapshot(client) - before).script_calls
        print(f"  A: {flood:,} sent in {res.publish_s:.1f}s ({res.a_parked_at_publish:,} parked at publish, "
              f"queue {client.llen(queue):,}); B: {len(sent)} sent; starting the worker ...", flush=True)
        group = worker(prefix, f"rpt-nb-{task}-{check}-{flood}", env)
        group.start()
        ready = wait_until(lambda: client.lrange(f"{prefix}:ready", 0, -1), 30, 0.05)
        if not ready:
            raise RuntimeError("the worker never noted worker_ready")
        ready_at = min(float(x) for x in ready)
        deadline = time.monotonic() + 120 + flood / 200
        a_done = None
        while time.monotonic() < deadline:
            q, _, parked = _end_state(client, queue, prefix)
            if a_done is None and parked >= flood and not q:
                a_done = time.time()
            if client.llen(f"{prefix}:starts:B") >= B_TASKS and a_done is not None:
                break
            time.sleep(POLL)
        time.sleep(3.0)  # a second run of a B task would show by now
        res.stats = snapshot(client) - before
        starts = _starts(client, prefix, "B")
        res.b_runs = Counter(task_id for _, task_id in starts)
        first = {}
        for t, task_id in sorted(starts):
            first.setdefault(task_id, t)
        res.b_latency = sorted(t - ready_at for task_id, t in first.items() if task_id in sent)
        res.a_started = int(client.llen(f"{prefix}:starts:A"))
        res.a_parked = _end_state(client, queue, prefix)[2]
        res.a_done_s = (a_done - ready_at) if a_done else float("nan")
        res.errors = group.errors()
    except Exception as exc:  # noqa: BLE001 - a failed run is a row
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if group is not None:
            group.stop()
        server.stop()
    return res


# -- learning: a key whose tasks waited for the first worker -----------------------------
@dataclass
class Learn:
    task: str = "learn"
    early_sent: int = 0
    early_ran: int = 0
    early_after_ready: list[float] = field(default_factory=list)
    fresh: dict[str, list[float]] = field(default_factory=dict)
    dups: int = 0
    error: str = ""


def run_learn(binary: str, task: str = "learn") -> Learn:
    res = Learn(task)
    prefix = new_prefix()
    queue = f"{prefix}-q"
    server = DedicatedRedis(f"rpt-{task}", binary)
    group = None
    try:
        server.start()
        client = server.client
        env = _env(server, prefix, queue, None)
        early = produce(env, task, LEARN_EARLY, ("K",))
        res.early_sent = early["sent"]
        print(f"  {LEARN_EARLY} tasks of key K sent; the worker starts {LEARN_AHEAD:.0f}s after ...", flush=True)
        time.sleep(max(early["first"] + LEARN_AHEAD - time.time(), 0))
        group = worker(prefix, f"rpt-{task}", env)
        group.start()
        ready = wait_until(lambda: client.lrange(f"{prefix}:ready", 0, -1), 30, 0.05)
        ready_at = min(float(x) for x in ready) if ready else float("nan")
        wait_until(lambda: client.llen(f"{prefix}:starts:K") >= LEARN_EARLY, 60, 0.1)
        early_starts = _starts(client, prefix, "K")
        res.early_ran = len({i for _, i in early_starts})
        res.early_after_ready = sorted(t - ready_at for t, _ in early_starts)
        time.sleep(1.0)
        for key in ("K", "fresh-key"):
            have = client.llen(f"{prefix}:starts:{key}")
            report = produce(env, task, LEARN_BURST, (key,), ids=True, bursts=LEARN_BURSTS, gap=LEARN_GAP)
            sent = report["ids"]
            want = have + len(sent)
            wait_until(lambda key=key, want=want: client.llen(f"{prefix}:starts:{key}") >= want, 120, 0.1)
            time.sleep(1.0)
            starts = _starts(client, prefix, key)
            counts = Counter(i for _, i in starts if i in sent)
            res.dups += sum(c - 1 for c in counts.values())
            first: dict[str, float] = {}
            for t, i in sorted(starts):
                first.setdefault(i, t)
            res.fresh[key] = sorted(first[i] - s for i, s in sent.items() if i in first)
    except Exception as exc:  # noqa: BLE001 - a failed run is a row
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if group is not None:
            group.stop()
        server.stop()
    return res


# -- the section -------------------------------------------------------------------------
def run_redis_per_task(res: Results, quick: bool = False, sizes: tuple[int, ...] = ()) -> None:
    plan = QUICK if quick else FULL
    if sizes:  # (the per-task rows at these sizes, the largest as the full plan's, and the quick neighbours)
        plan = Plan(sizes, big=FULL.big, neighbour=QUICK.neighbour)
    binary = redis_binary()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             check=False).stdout.split()[2]
    started = time.time()
    runs: list[Run] = []
    largest = max(plan.sizes)
    for n in plan.sizes:
        for which, variants in (("under", UNDER), ("flood", FLOOD)):
            for variant in variants:
                if n == largest and len(plan.sizes) > 1 and (which, variant.name) not in plan.big:
                    continue
                print(f"Redis per task: {which}, {variant.name}, {n:,} tasks ...", flush=True)
                run = run_per_task(binary, variant, n)
                runs.append(run)
                print(f"  {_line(run)}", flush=True)
    neighbours = []
    for check, flood, task in plan.neighbour:
        print(f"Redis per task: prefilled noisy neighbour, {_nb_name(check, task)}, flood of {flood:,} ...",
              flush=True)
        neighbours.append(run_neighbour_prefilled(binary, check, flood, task))
    learns = []
    for task in plan.learn:
        print(f"Redis per task: {task}: a key's tasks sent 60 s before the first worker, then fresh ones ...",
              flush=True)
        learns.append(run_learn(binary, task))
    elapsed = time.time() - started
    _report(res, runs, neighbours, learns, plan, version, elapsed)


def _nb_name(check: str, task: str) -> str:
    return (f"ours, check at publish {'on' if check == '1' else 'off'}" + (ABOVE if task.endswith("_above") else "")
            + (", task without bind=True" if task.endswith("_unbound") else ""))


def _line(run: Run) -> str:
    if run.error:
        return f"failed: {run.error}"
    s = run.stats
    return (f"{run.per_task(s.script_calls):.2f} calls/task, {run.per_task(s.script_us):.1f} script µs/task, "
            f"{run.per_task(s.cpu_s) * 1e6:.1f} CPU µs/task; publish {run.publish_s:.1f}s, all "
            f"{run.total_s:.1f}s{'' if run.done else ' (NOT finished)'}; end {run.end}, accepted {run.ran}")


def _fmt(x: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(x) else f"{x:,.{digits}f}"


def _report(res: Results, runs: list[Run], neighbours: list[Neighbour], learns: list[Learn], plan: Plan,
            version: str, elapsed: float) -> None:
    plain = {r.tasks: r for r in runs if r.variant is PLAIN and not r.error and r.done}
    lines = [f"#### Redis per task (section 12): {elapsed:.0f} s, a redis-server {version} of its own per run "
             "(broker and store), 1 worker x 2 prefork processes, producers in their own process "
             "(import + .delay())", "",
             "| Set | Variant | Tasks | Script calls/task | Script µs/task | Server CPU µs/task | CPU / plain "
             "| Publish s | Publish + drain s | Idle CPU ms/s | End |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        which = "flood (100/h spent)" if run.variant.flood else "under (1000000/s)"
        if run.error:
            lines.append(f"| {which} | {run.variant.name} | {run.tasks:,} | failed: {run.error} | | | | | | | |")
            res.add(SEC, f"{which}, {run.tasks:,} tasks", run.variant.name, "failed", "", False, run.error)
            continue
        s, base = run.stats, plain.get(run.tasks)
        cpu = run.per_task(s.cpu_s) * 1e6
        ratio = cpu / (base.per_task(base.stats.cpu_s) * 1e6) if base else float("nan")
        calls = run.per_task(s.script_calls)
        end = _end_text(run)
        lines.append(f"| {which} | {run.variant.name} | {run.tasks:,} | {calls:.2f} | "
                     f"{_fmt(run.per_task(s.script_us), 1)} | {cpu:.1f} | {_fmt(ratio)}x | {run.publish_s:.1f} | "
                     f"{run.total_s:.1f} | {run.idle * 1000:.1f} | {end} |")
        ours_on = run.variant.check == "1" and not run.variant.flood
        res.add(SEC, f"{which}, {run.tasks:,} tasks: script calls/task", run.variant.name, f"{calls:.2f}",
                f"<= {CALLS_TARGET}" if ours_on else "", (calls <= CALLS_TARGET) if ours_on else None,
                f"{_fmt(run.per_task(s.script_us), 1)} script µs/task")
        res.add(SEC, f"{which}, {run.tasks:,} tasks: Redis CPU/task vs plain", run.variant.name,
                f"{cpu:.1f} µs ({_fmt(ratio)}x)", f"<= {CPU_TARGET}x" if ours_on else "",
                (ratio <= CPU_TARGET) if ours_on and not math.isnan(ratio) else None, end)
        if run.errors:
            res.notes.append(f"Redis per task, {run.variant.name}, {run.tasks:,}: worker log errors "
                             f"({len(run.errors)}): " + " | ".join(run.errors[:3]))
    if neighbours:
        lines += ["", "| Noisy neighbour, prefilled | A's flood | A sent in | Script calls while publishing | Parked at publish "
                  "| B's start after "
                  "the worker is ready: p50 / max | B ran once | A started | A all parked after ready | "
                  "Script calls / µs per A task | CPU µs per A task |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
    for nb in neighbours:
        name = _nb_name(nb.check, nb.task)
        if nb.error:
            lines.append(f"| {name} | {nb.flood:,} | failed: {nb.error} | | | | | | | | |")
            res.add(SEC, f"prefilled neighbour, flood of {nb.flood:,}", name, "failed", "", False, nb.error)
            continue
        lat = nb.b_latency
        once = sum(1 for c in nb.b_runs.values() if c == 1)
        dups = sum(c - 1 for c in nb.b_runs.values())
        ok_once = once == B_TASKS and dups == 0 and nb.b_sent == B_TASKS
        if len(lat) == B_TASKS:
            p50, top = percentile(lat, 0.5), lat[-1]
            value = f"p50 {p50:.2f}s, max {top:.2f}s"
        else:
            p50 = float("nan")
            value = f"{len(lat)}/{B_TASKS} started"
        per = nb.flood + B_TASKS
        lines.append(f"| {name} | {nb.flood:,} | {nb.publish_s:.1f}s | {nb.publish_calls:,} | {nb.a_parked_at_publish:,} | "
                     f"{value} | "
                     f"{once}/{B_TASKS}, {dups} dup | {nb.a_started} | {_fmt(nb.a_done_s, 1)}s | "
                     f"{nb.stats.script_calls / per:.2f} / {nb.stats.script_us / per:.1f} | "
                     f"{nb.stats.cpu_s / per * 1e6:.1f} |")
        on = nb.check == "1"
        res.add(SEC, f"prefilled neighbour, flood of {nb.flood:,}: B's start after the first worker is ready",
                name, value, f"p50 <= {B_TARGET:g}s" if on else "", (p50 <= B_TARGET) if on else None,
                f"A's {nb.flood:,} sent with no worker running, then B's {B_TASKS}")
        res.add(SEC, f"prefilled neighbour, flood of {nb.flood:,}: each B task ran once", name,
                f"{once}/{B_TASKS}, {dups} dup", "all, 0 dup", ok_once)
        if nb.errors:
            res.notes.append(f"Redis per task, neighbour {name} {nb.flood:,}: worker log errors "
                             f"({len(nb.errors)}): " + " | ".join(nb.errors[:3]))
    if learns:
        lines += ["", "| Learning | Tasks | Start latency from .delay(): p50 / max |", "|---|---|---|"]
    for learn in learns:
        order = {"learn_above": "@throttle above @app.task: ",
                 "learn_unbound": "task without bind=True: "}.get(learn.task, "")
        variant = "ours, check at publish on" + {"learn_above": ABOVE,
                                                 "learn_unbound": ", task without bind=True"}.get(learn.task, "")
        if learn.error:
            lines.append(f"| {order}failed | | {learn.error} |")
            res.add(SEC, "learning", variant, "failed", "", False, learn.error)
        else:
            early = learn.early_after_ready
            lines.append(f"| {order}key K: sent {LEARN_AHEAD:.0f}s before the first worker (from its ready) | "
                         f"{learn.early_ran}/{learn.early_sent} ran | "
                         f"{_fmt(percentile(early, 0.5))}s / {_fmt(early[-1] if early else float('nan'))}s |")
            for key, label in (("K", "key K afterwards"), ("fresh-key", "a key never seen before")):
                lat = learn.fresh.get(key, [])
                sent = LEARN_BURST * LEARN_BURSTS
                lines.append(f"| {order}{label}: {LEARN_BURSTS} bursts of {LEARN_BURST}, {LEARN_GAP:g}s apart | "
                             f"{len(lat)}/{sent} ran | {_fmt(percentile(lat, 0.5) * 1000, 0)} ms / "
                             f"{_fmt((lat[-1] if lat else float('nan')) * 1000, 0)} ms |")
                res.add(SEC, f"learning: start latency, {label}", variant,
                        f"p50 {_fmt(percentile(lat, 0.5) * 1000, 0)} ms, max "
                        f"{_fmt((lat[-1] if lat else float('nan')) * 1000, 0)} ms ({len(lat)}/{sent})", "", None,
                        f"{LEARN_EARLY} tasks of key K sent {LEARN_AHEAD:.0f}s before the first worker started"
                        if key == "K" else "")
            if learn.dups:
                res.notes.append(f"Learning, {variant}: {learn.dups} fresh task(s) ran more than once")
    skipped = [f"{w}/{v}" for w in ("under", "flood") for v in
               (x.name for x in (UNDER if w == "under" else FLOOD)) if (w, v) not in plan.big]
    if len(plan.sizes) > 1 and skipped:
        lines += ["", f"At {max(plan.sizes):,} tasks only: " + ", ".join(f"{w}/{v}" for w, v in plan.big)
                  + " (time); skipped there: " + ", ".join(skipped) + "."]
    res.tables.append("\n".join(lines))


def _end_text(run: Run) -> str:
    text = _end_state_text(run)
    return text + (f"; {len(run.errors)} error lines in the worker log" if run.errors else "")


def _end_state_text(run: Run) -> str:
    q, unacked, parked = run.end
    if not run.done:
        return f"NOT finished: queue {q:,}, unacked {unacked:,}, parked {parked:,}"
    if not run.variant.flood:
        return f"all ran ({run.ran:,} accepted)" if run.ran is not None else "all ran"
    if run.variant.peer:
        return f"{unacked:,} waiting in the worker for their countdown"
    return f"{parked:,} waiting in their lines"


def main() -> int:
    """``python -m bench.redis_per_task [--quick | --sizes=N,N | CHECK:FLOOD:TASK ...]``: the section alone
    (``--sizes``: its per-task rows at those sizes, the quick plan's neighbour rows),
    or only the prefilled-neighbour runs named (e.g. ``1:10000:neighbour_unbound``) and
    learning runs (``learn:0:TASK``), printed."""
    from bench import report

    res = Results()
    wanted = [a.split(":") for a in sys.argv[1:] if a.count(":") == 2]
    if wanted:  # CHECK:FLOOD:TASK ...: those prefilled-neighbour runs alone
        binary = redis_binary()
        version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                                 check=False).stdout.split()[2]
        started = time.time()
        runs = [run_neighbour_prefilled(binary, c, int(f), t) for c, f, t in wanted if c != "learn"]
        learns = [run_learn(binary, t) for c, _, t in wanted if c == "learn"]
        _report(res, [], runs, learns, QUICK, version, time.time() - started)
    else:
        sizes = next((tuple(int(n) for n in a.removeprefix("--sizes=").split(",")) for a in sys.argv[1:]
                      if a.startswith("--sizes=")), ())
        run_redis_per_task(res, quick="--quick" in sys.argv, sizes=sizes)
    report.print_table(res, "Redis per task")
    return 0


if __name__ == "__main__":
    sys.exit(main())
