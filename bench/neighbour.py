"""Section 10: a noisy neighbour.

Tenant A, whose quota (``100/h`` per tenant) is spent, sends a flood of N tasks; 3 s
after the flood is sent, tenant B (quota untouched, same task, another key) sends 10.
B's tasks should start within about a second whatever N. Two workers x 2 prefork
processes consume one queue. Variants, each on fresh keys (labels of its own) and fresh
workers, with the queue and the parked tasks cleared after it:

* ``celery_throttle``: default settings. The producer is ``bench.workerapp`` itself,
  imported in this process with the workers' settings (same store, prefix and
  ``celery_throttle.install``), so a check at publish, where the package does one,
  happens as in an application;
* ``celery_throttle, check at publish off``: ``throttle_check_at_publish = False`` in
  the producer and the workers: only the workers turn A's messages away;
* ``no throttle``: the same no-op without a limit (A's tasks simply run);
* ``naive sliding log``: bench/naive.py's limiter in the task, which re-sends itself with
  ``retry(countdown=...)`` when denied (as the burst baselines do).

The flood lands at once: this one process publishes about a thousand tasks a second,
slower than the workers turn them away, so the workers open the flood's queue only once
it is all published (as section 8 does). B's tasks go to the same queue, behind what is
left of the flood.

Reported per N: B's start latency (p50, max) from each B task's send; how long after
the flood was published every A task had been turned away (denied once: the denial
counter of the ``task_throttled`` signal, or the parked count, whichever is higher), or
had run (no throttle); and how long publishing the flood took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from bench.common import (
    BROKER_URL,
    STORE_URL,
    Results,
    broker_client,
    delete_prefix,
    import_configured,
    percentile,
    store_client,
)
from bench.naive import NaiveLimiter
from celery_throttle.core.config import Settings
from celery_throttle.core.keys import parking_keys
from celery_throttle.core.rates import parse_rate

SEC = "10 noisy neighbour"
QUOTA = "100/h"
B_TASKS = 10
B_AFTER = 3.0
B_TARGET = 1.0
#: Floods this big run only for these variants (the section must stay short).
BIG_FLOOD = 100_000
BIG_VARIANTS = ("celery_throttle", "no throttle", "naive sliding log")
#: The longest a run waits (s) for B's tasks and the end of the flood once it is published.
MAX_WAIT = 150.0


@dataclass(frozen=True)
class Variant:
    name: str
    task: str  # in bench.workerapp
    spend: str | None  # how A's quota is spent: "ours", "naive" or not at all
    check_at_publish: bool | None = None  # None: the package's default

    @property
    def slug(self) -> str:
        return {"celery_throttle": "ct", "celery_throttle, check at publish off": "ctoff",
                "no throttle": "plain", "naive sliding log": "naive"}[self.name]


VARIANTS = (
    Variant("celery_throttle", "neighbour", "ours"),
    Variant("celery_throttle, check at publish off", "neighbour", "ours", check_at_publish=False),
    Variant("no throttle", "plain", None),
    Variant("naive sliding log", "neighbour_naive", "naive"),
)


@dataclass
class Run:
    """What one flood of one variant gave."""

    variant: str
    flood: int
    publish_s: float = float("nan")
    #: Seconds from the flood's first send until every A task was turned away (or ran).
    flood_done_s: float = float("nan")
    turned: int = 0
    #: A's tasks turned away by the producer, by the end of publishing.
    at_publish: int = 0
    b_latency: list[float] = field(default_factory=list)
    #: Seconds waited after B's send, and after the flood was published.
    waited: float = 0.0
    watched: float = 0.0
    errors: list[str] = field(default_factory=list)


def publish_check_supported() -> bool:
    """Whether this celery_throttle has ``throttle_check_at_publish``."""
    return "check_at_publish" in {f.name for f in fields(Settings)}


def producer(prefix: str) -> Any:
    """``bench.workerapp``, imported in this process configured like the workers."""
    wa = import_configured("bench.workerapp", {
        "CB_PREFIX": prefix, "CB_STORE": STORE_URL, "CB_BROKER": BROKER_URL, "CB_NEIGHBOUR_RATE": QUOTA,
        "CB_QUEUE": f"{prefix}-neighbour-idle"})
    if wa.NEIGHBOUR_RATE != QUOTA:
        raise RuntimeError("bench.workerapp was imported earlier in this process with other settings")
    return wa


class _Watch(threading.Thread):
    """Samples ``probe()`` every ``interval`` seconds: (time, *values)."""

    def __init__(self, probe: Callable[[], tuple[int, ...]], interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.probe = probe
        self.interval = interval
        self.samples: list[tuple[float, ...]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), *self.probe()))
            self.done.wait(self.interval)

    def first(self, index: int, at_least: int) -> float | None:
        """When value ``index`` first reached ``at_least``."""
        return next((s[0] for s in self.samples if s[index] >= at_least), None)


def run_one(wa: Any, prefix: str, variant: Variant, flood: int, check_supported: bool) -> Run:
    from bench.workers import WorkerGroup

    run = Run(variant.name, flood)
    tag = f"nb-{variant.slug}-{flood}"
    a, b = f"{tag}-A", f"{tag}-B"
    env = {"CB_NEIGHBOUR_RATE": QUOTA}
    if check_supported:
        flag = True if variant.check_at_publish is None else variant.check_at_publish
        env["CB_CHECK_AT_PUBLISH"] = "1" if flag else "0"
        import celery_throttle

        celery_throttle.install(wa.app, check_at_publish=flag)
    task = getattr(wa, variant.task)
    quota = parse_rate(QUOTA)
    records = store_client()
    due, _, inflight = parking_keys(prefix)
    group = WorkerGroup(prefix, tag, env=env)
    try:
        group.start()
        if variant.spend == "ours":
            spent = wa.ctl.acquire(task.name, key=a, rates=QUOTA, cost=quota.limit)
            if not spent.allowed:
                raise RuntimeError(f"could not spend {a}'s quota: {spent}")
        elif variant.spend == "naive":
            naive = NaiveLimiter(records, "sliding")
            for i in range(quota.limit):
                naive.hit(f"{prefix}:naive-sliding:{a}", quota.limit, quota.period, member=f"spent-{i}")

        def probe() -> tuple[int, ...]:
            pipe = records.pipeline(transaction=False)
            pipe.get(f"{prefix}:denied:{a}")
            pipe.zcard(due)
            pipe.zcard(inflight)
            pipe.llen(f"{prefix}:starts:{a}")
            pipe.llen(f"{prefix}:starts:{b}")
            denied, waiting, held, a_started, b_started = pipe.execute()
            return max(int(denied or 0), int(waiting) + int(held)), int(a_started), int(b_started)

        watch = _Watch(probe)
        watch.start()
        # The flood lands at once: the workers open its queue once it is all published
        # (this one process publishes ~1 000 tasks/s, slower than the workers drain them).
        queue = f"{group.queue}-flood"
        t0 = time.time()
        with wa.app.producer_or_acquire() as pub:
            for _ in range(flood):
                task.apply_async((a,), queue=queue, producer=pub)
        t1 = time.time()
        run.publish_s = t1 - t0
        run.at_publish = probe()[0]  # turned away by the producer itself
        print(f"  published {flood:,} in {run.publish_s:.1f}s", flush=True)
        if group.consume(queue) < group.count:
            raise RuntimeError(f"workers did not start consuming {queue}")
        time.sleep(max(t1 + B_AFTER - time.time(), 0))
        sent_at: dict[str, float] = {}
        with wa.app.producer_or_acquire() as pub:
            for _ in range(B_TASKS):
                t = time.time()
                sent_at[task.apply_async((b,), queue=queue, producer=pub).id] = t
        index = 2 if variant.spend is None else 1  # no throttle: A's tasks run
        deadline = time.monotonic() + min(60 + flood * 0.004, MAX_WAIT)
        while time.monotonic() < deadline:
            last = watch.samples[-1] if watch.samples else (0, 0, 0, 0)
            if last[3] >= B_TASKS and last[index] >= flood:
                break
            time.sleep(0.2)
        run.waited = time.time() - min(sent_at.values())
        run.watched = time.time() - t1
        watch.done.set()
        watch.join(5)
        done_at = t1 if variant.spend and run.at_publish >= flood else watch.first(index, flood)
        run.flood_done_s = max(done_at - t1, 0.0) if done_at else float("nan")
        run.turned = int(watch.samples[-1][index]) if watch.samples else 0
        run.b_latency = sorted(t - sent_at[i] for t, i in group.starts(b) if i in sent_at)
        run.errors = group.errors()
    finally:
        group.stop()
        _clear(prefix, group.queue)
    return run


def _clear(prefix: str, queue: str) -> None:
    """Drop what a run leaves: its queues, messages held by the stopped workers, parked tasks."""
    broker = broker_client()
    broker.unlink(queue, f"{queue}-flood", "unacked", "unacked_index", "unacked_mutex")
    store = store_client()
    store.unlink(*parking_keys(prefix))
    delete_prefix(store, f"{prefix}:naive-")


def run_neighbour(res: Results, prefix: str, floods: Sequence[int]) -> None:
    supported = publish_check_supported()
    wa = producer(prefix)
    runs: list[Run] = []
    try:
        for flood in floods:
            for variant in VARIANTS:
                if variant.check_at_publish is not None and not supported:
                    continue
                if flood >= BIG_FLOOD and variant.name not in BIG_VARIANTS:
                    continue
                print(f"noisy neighbour: {variant.name}, flood of {flood:,} ...", flush=True)
                runs.append(run_one(wa, prefix, variant, flood, supported))
    finally:
        if supported:
            import celery_throttle

            celery_throttle.install(wa.app, check_at_publish=True)
        wa.ctl.store.close()
        wa.app.close()
    _report(res, runs, floods, supported)


def _report(res: Results, runs: list[Run], floods: Sequence[int], supported: bool) -> None:
    for run in runs:
        n = f"{run.flood:,}"
        ours = run.variant == "celery_throttle"
        lat = run.b_latency
        if len(lat) < B_TASKS:
            value = f"{len(lat)}/{B_TASKS} started in {run.waited:.0f}s"
            ok = False
        else:
            p50 = percentile(lat, 0.5)
            value = f"p50 {p50:.2f}s, max {lat[-1]:.2f}s"
            ok = p50 <= B_TARGET
        res.add(SEC, f"flood of {n}: B's start after its send", run.variant, value,
                f"p50 <= {B_TARGET:g}s" if ours else "", ok if ours else None,
                f"B's {B_TASKS} tasks sent {B_AFTER:g}s after A's flood was published")
        plain = run.variant == "no throttle"
        what = "ran" if plain else "turned away (each denied once)"
        if run.flood_done_s == run.flood_done_s:
            done = f"{run.flood_done_s:.1f}s"
        else:
            done = f"not in {run.watched:.0f}s: {run.turned:,}/{run.flood:,}"
        note = f"after the flood was published (in {run.publish_s:.1f}s) and its queue opened"
        if run.variant.startswith("celery_throttle"):
            note += f"; turned away at publish: {run.at_publish:,}"
        if run.flood_done_s != run.flood_done_s and run.turned and run.watched:
            pace = run.turned / run.watched
            note += f"; at {pace:,.0f}/s the whole flood takes ~{run.flood / pace:,.0f}s"
        res.add(SEC, f"flood of {n}: all of A's tasks {what}", run.variant, done, "", None, note)
        if run.errors:
            res.notes.append(f"noisy neighbour, {run.variant}, {n}: worker log errors ({len(run.errors)}): "
                             + " | ".join(run.errors[:3]))
    big = [f for f in floods if f >= BIG_FLOOD]
    if big:
        res.notes.append(f"Noisy neighbour: the flood of {big[0]:,} runs only for "
                         f"{', '.join(BIG_VARIANTS)} (time).")
    if not supported:
        res.notes.append("Noisy neighbour: this celery_throttle has no throttle_check_at_publish: only the "
                         "workers turn A's messages away, and the 'check at publish off' variant is skipped.")
    res.notes.append(f"Noisy neighbour: quota {QUOTA} per tenant, A's spent first; 2 workers x 2 prefork "
                     "processes, one queue; the producer is bench.workerapp in the bench process, configured "
                     "like the workers.")
