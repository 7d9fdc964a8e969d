"""Section 14: concurrency slots, K=4 per tenant.

Two workers x 4 prefork processes; bodies of 200 ms. A producer process (as users write
one, bench/slots_producer.py) sends tenant a's flood of N tasks, then tenant b's 20.
Each run has a redis-server of its own (broker and throttle store, as for most users), so
its ``INFO commandstats`` and ``INFO cpu`` are the run's alone. Reported per N:

* the most bodies of one tenant running at once (from each body's start and end): <= K;
* b's start latency from each send (p50, target <= 1 s): a's flood waits off the queue,
  kept at publish, and leaves the other processes to b;
* a's makespan against the ideal N x 0.2 s / K, and the processes' utilisation against
  the ideal for this load (a can use K of the 8 processes);
* Redis per task: the script calls (each one round trip), every command the server ran
  (the broker's, and those run inside the scripts: ``INFO commandstats`` counts both), and
  the server's CPU per task.

The same run with the body not throttled (``plain``) is the baseline: its calls per task
are Celery's own, and b waits behind a's flood.

Then the time for a slot held by a SIGKILLed worker to be reclaimed: the holder's worker
(and its pool) is killed while the key's one slot is its; the next task, already waiting,
starts when the lease (3 s here, ``throttle_concurrency_lease``) has run out and a
worker's sweep (``slots.SWEEP_EVERY_S``) hands the slot on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.backlog import dedicated_redis
from bench.common import ROOT, Results, percentile, wait_until
from bench.redis_per_task import redis_binary, snapshot
from bench.workers import WorkerGroup

SEC = "14 concurrency"
K = 4
BODY_S = 0.2
OTHERS = 20
PROCESSES = 8
B_TARGET_S = 1.0
KILL_LEASE_S = 3.0


def _spans(client: Any, prefix: str) -> list[tuple[float, float, str]]:
    out = []
    for raw in client.lrange(f"{prefix}:spans", 0, -1):
        t0, t1, tenant, _, _ = raw.decode().split()
        out.append((float(t0), float(t1), tenant))
    return out


def most_at_once(spans: Sequence[tuple[float, float, str]], tenant: str) -> int:
    edges = sorted([(t0, 1) for t0, _, who in spans if who == tenant] + [(t1, -1) for _, t1, who in spans
                                                                       if who == tenant])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def _env(url: str, prefix: str, lease: float = 30.0) -> dict[str, str]:
    return {"CB_BROKER": url, "CB_PREFIX": prefix, "CB_QUEUE": f"{prefix}-q", "CB_SLOT_LEASE": str(lease)}


def _group(prefix: str, env: dict[str, str], concurrency: int) -> WorkerGroup:
    group = WorkerGroup(prefix, "slots", count=2, concurrency=concurrency, env=env, app="bench.slots_app")
    group.queue = env["CB_QUEUE"]
    return group


def run_flood(res: Results, prefix: str, flood: int, task: str) -> None:
    with dedicated_redis("slots", redis_binary()) as server:
        run = f"{prefix}-{task}-{flood}"
        env = _env(server.url, run)
        group = _group(run, env, PROCESSES // 2)
        try:
            group.start()
            before = snapshot(server.client)
            out = subprocess.run([sys.executable, "-m", "bench.slots_producer", task, str(flood), str(OTHERS),
                                  str(BODY_S)],
                                 cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **env), capture_output=True,
                                 text=True, timeout=600, check=True)
            sent = json.loads(out.stdout.strip().splitlines()[-1])
            total = flood + OTHERS
            timeout = flood * BODY_S / (K if task == "export" else PROCESSES) * 3 + 60
            if not wait_until(lambda: server.client.llen(f"{run}:spans") >= total, timeout, 0.2):
                raise RuntimeError(f"{server.client.llen(f'{run}:spans')} of {total} bodies ran in {timeout:.0f}s")
            after = snapshot(server.client)
        finally:
            group.stop()
        spans = _spans(server.client, run)
    a = [s for s in spans if s[2] == "a"]
    b_starts = sorted(t0 for t0, _, who in spans if who == "b")
    latencies = sorted(start - sent_at for start, sent_at in zip(b_starts, sent["b_sends"], strict=True))
    makespan = max(t1 for _, t1, _ in a) - sent["t0"]
    limit = K if task == "export" else PROCESSES
    ideal = flood * BODY_S / limit
    busy = sum(t1 - t0 for t0, t1, _ in spans)
    whole = max(t1 for _, t1, _ in spans) - sent["t0"]
    ideal_busy = min(PROCESSES, limit) * whole  # (a alone can use `limit` processes; b's 20 are a moment)
    delta = after - before
    size, variant = f"N={flood:,}", f"{'K=4' if task == 'export' else 'plain Celery'}, N={flood:,}"
    if task == "export":
        res.add(SEC, "most of one tenant running at once", size,
                f"a {most_at_once(spans, 'a')}, b {most_at_once(spans, 'b')}", f"<= {K}",
                most_at_once(spans, "a") <= K and most_at_once(spans, "b") <= K)
    p50 = percentile(latencies, 0.5)
    res.add(SEC, "b's start latency p50 / max", variant, f"{p50:.2f} s / {latencies[-1]:.2f} s",
            f"p50 <= {B_TARGET_S:.0f} s" if task == "export" else "", p50 <= B_TARGET_S if task == "export" else None,
            note="b's 20 are capped at K too: 5 rounds of 0.2 s" if task == "export" else "behind a's flood")
    res.add(SEC, "a's makespan / ideal", variant, f"{makespan:.1f} s / {ideal:.1f} s = {makespan / ideal:.2f}")
    res.add(SEC, "utilisation / ideal for this load", variant, f"{busy / ideal_busy:.2f}",
            note=f"bodies busy {busy:.0f} s of {min(PROCESSES, limit)} processes x {whole:.0f} s")
    res.add(SEC, "Redis commands per task (all / script calls)", variant,
            f"{delta.commands / total:.1f} / {delta.script_calls / total:.1f}",
            note="all: the broker's, and those each script runs inside it (INFO commandstats counts both)")
    res.add(SEC, "Redis CPU per task", variant, f"{delta.cpu_s / total * 1e6:.0f} µs")


def run_reclaim(res: Results, prefix: str) -> None:
    with dedicated_redis("slots-kill", redis_binary()) as server:
        run = f"{prefix}-kill"
        env = _env(server.url, run, KILL_LEASE_S)
        group = _group(run, env, 1)
        try:
            group.start()
            producer = dict(os.environ, PYTHONPATH=str(ROOT), **env)
            code = "from bench import slots_app as s; import sys; s.export_one.delay(sys.argv[1], float(sys.argv[2]))"
            subprocess.run([sys.executable, "-c", code, "k", "60"], cwd=ROOT, env=producer, check=True, timeout=60)
            if not wait_until(lambda: server.client.llen(f"{run}:began") >= 1, 30, 0.1):
                raise RuntimeError("the holder did not start")
            _, _, ppid = server.client.lindex(f"{run}:began", 0).decode().split()
            subprocess.run([sys.executable, "-c", code, "k", "0"], cwd=ROOT, env=producer, check=True, timeout=60)
            time.sleep(1.0)
            victim = next(p for p in group.procs if p.pid == int(ppid))
            os.killpg(victim.pid, 9)
            killed = time.time()
            if not wait_until(lambda: server.client.llen(f"{run}:began") >= 2, 60, 0.05):
                raise RuntimeError("the next task did not start within 60 s of the kill")
            start = float(server.client.lindex(f"{run}:began", 1).decode().split()[0])
        finally:
            group.stop()
    took = start - killed
    res.add(SEC, "slot of a SIGKILLed worker reclaimed after", f"lease {KILL_LEASE_S:.0f} s", f"{took:.1f} s",
            f"<= lease + {5:.0f} s sweep", took <= KILL_LEASE_S + 5 + 1)


def run_concurrency(res: Results, prefix: str, floods: Sequence[int]) -> None:
    for flood in floods:
        for task in ("export", "plain"):
            print(f"  concurrency: flood of {flood:,} ({task}) ...", flush=True)
            run_flood(res, prefix, flood, task)
    print("  concurrency: SIGKILL reclaim ...", flush=True)
    run_reclaim(res, prefix)
