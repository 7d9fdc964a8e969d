"""Section 47 (many keys, issue 47): thousands of keys at their limit, beside plain Celery.

Each run: a redis-server of its own (the broker on db 1, the store on db 0: one server, as users run
it), 2 workers x 4 prefork started first, then one producer process that imports the tasks and sends,
for each of ``keys`` tenants, ``per_key`` trivial tasks in a row (a tenant's tasks at once, the
tenants one after another), against ``5/s`` per tenant: the first ``5`` of a tenant start, the rest
wait in its line and are released over the next seconds. Measured: the producer's sends, first send
to the last start, the most starts of a tenant in any 1 s, the server's
commands, script calls and CPU per task, and the workers' CPU per task (their processes' and their pools', from
/proc), beside plain Celery sending the same tasks unthrottled.

With ``--admitted N``, N runs more of each size with the record on (``throttle_record``), whose start
events carry the start the store admitted (its clock): the most starts of a tenant in any 1 s by those, beside
the bodies' own notes (taken after the claim: a body that began late bunches with the next window's).

With ``--ops``, a run more at the fewest keys, on a server that logs every command (SLOWLOG at 0 µs): the
script calls of each operation per task, and the server's µs per call of each.

With ``--processes 1,2,4``, a run (and a row) per number of prefork processes of each of the 2 workers.

With ``--cluster``, the throttled runs again with the store on a Redis Cluster of 3 masters started on
loopback (the broker and the notes on a server of their own): each master's share of the store's commands,
script calls and CPU (target: no master more than 45 % of the commands).

``python -m bench.many_keys [--keys 100,2000] [--per-key 15] [--processes 4] [--ops] [--admitted N] [--cluster]``
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from dataclasses import astuple
from pathlib import Path
from typing import Any

import redis

from bench.common import Counts, Results, counts, md, new_prefix, produce, running, served, standalone
from celery_throttle.core.keys import record_key
from tests.harness import redis_cluster, redis_server

SEC = "47 many keys"
#: Issue 47's targets: against plain Celery's makespan, and per task that waits.
MAKESPAN_TARGET, CALLS_TARGET, COMMANDS_TARGET = 1.5, 2.0, 30.0
#: Issue 47's target on a Redis Cluster of CLUSTER_MASTERS masters: the most of the store's commands one takes.
CLUSTER_MASTERS, MASTER_TARGET = 3, 0.45
KEYS, PER_KEY, LIMIT = (100, 2_000), 15, 5
#: Prefork processes of each of the 2 workers (``--processes``: a row per number).
PROCESSES = 4


def most_in_a_second(starts: list[dict[str, Any]]) -> int:
    """The most starts of one tenant in any 1 s."""
    by_key: dict[str, list[float]] = {}
    for s in starts:
        by_key.setdefault(s["id"], []).append(s["t"])
    most = 0
    for times in by_key.values():
        times.sort()
        first = 0
        for last, t in enumerate(times):
            while t - times[first] >= 1.0:
                first += 1
            most = max(most, last - first + 1)
    return most


def admitted_starts(store_url: str, prefix: str) -> list[dict[str, Any]]:
    """Each start as the store admitted it (the record's start events, the server's clock), with its key for its id."""
    client = redis.Redis.from_url(store_url)
    events = [json.loads(fields[b"e"]) for _, fields in client.xrange(record_key(prefix))]
    key_of = {e["id"]: e["key"] for e in events if e["k"] == "a"}
    return [{"id": key_of.get(e["id"], "?"), "t": e["t"] / 1e6} for e in events if e["k"] == "s"]


def process_cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) of process ``pid`` and every process under it, from /proc
    (Linux): a worker's main process and its pool's."""
    ticks, total, todo = os.sysconf("SC_CLK_TCK"), 0.0, [pid]
    while todo:
        at = todo.pop()
        try:
            fields = Path(f"/proc/{at}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # (utime, stime: the stat's 14th and 15th)
            for task in Path(f"/proc/{at}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def workers_cpu_s(group: Any) -> float:
    return sum(process_cpu_s(proc.pid) for proc in group.procs if proc is not None)


def one_run(task: str, keys: int, per_key: int, admitted: bool = False, processes: int = PROCESSES) -> dict[str, float]:
    """One run, 2 workers of ``processes`` prefork processes each; ``admitted``: with the record on
    (``throttle_record``: more commands per task), to count the starts as the store admitted them beside the
    bodies' own notes."""
    tenants, n = [f"t{k}" for k in range(keys)], keys * per_key
    env = {"CT_RECORD": str(4 * n)} if admitted else {}
    with served("keys", count=2, concurrency=processes, env=env) as (store, group):
        time.sleep(3.0)  # (the workers' start-up traffic is over)
        before, cpu_before = counts(group.records), workers_cpu_s(group)
        sent = produce(group, {"task": task, "count": n, "vary": tenants, "runs": per_key})[0]
        deadline = time.monotonic() + 600
        while not (done := group.started("keys") >= n) and time.monotonic() < deadline:
            time.sleep(0.2)
        got, workers_cpu = counts(group.records) - before, workers_cpu_s(group) - cpu_before
        starts = group.starts("keys")
        if admitted:
            time.sleep(1.5)  # (a process writes its record twice a second)
            by_store = admitted_starts(store.url, group.prefix)
    return {"sends": sent["last"] - sent["first"], "makespan": max(s["t"] for s in starts) - sent["first"],
            "commands": got.commands / n, "calls": got.script_calls / n, "cpu_us": got.cpu_s / n * 1e6,
            "workers_cpu_us": workers_cpu / n * 1e6,
            "most": most_in_a_second(starts), "done": float(done),
            **({"admitted": most_in_a_second(by_store), "recorded": len(by_store) / n} if admitted else {})}


def cluster_run(keys: int, per_key: int, processes: int = PROCESSES) -> tuple[list[Counts], dict[str, float]]:
    """One throttled run with the store on a Redis Cluster of CLUSTER_MASTERS masters: each master's counts
    (from the workers' start-up on: the producer's sends to the last start), and the run's figures."""
    tenants, n = [f"t{k}" for k in range(keys)], keys * per_key
    with redis_cluster(CLUSTER_MASTERS) as ports, redis_server() as server, \
            running(new_prefix("keys-cluster"), server, store=f"redis+cluster://127.0.0.1:{ports[0]}",
                    records=server.url, count=2, concurrency=processes) as group:
        masters = [redis.Redis(port=p) for p in ports]
        time.sleep(3.0)
        before = [counts(m) for m in masters]
        sent = produce(group, {"task": "keys_limit", "count": n, "vary": tenants, "runs": per_key})[0]
        deadline = time.monotonic() + 600
        while not (done := group.started("keys") >= n) and time.monotonic() < deadline:
            time.sleep(0.2)
        got = [counts(m) - b for m, b in zip(masters, before)]
        starts = group.starts("keys")
        for m in masters:
            m.close()
    return got, {"makespan": max(s["t"] for s in starts) - sent["first"], "most": most_in_a_second(starts),
                 "done": float(done)}


def cluster_rows(res: Results, keys: tuple[int, ...], per_key: int) -> None:
    """Each master's share of the store's work, a run per number of keys."""
    lines = []
    for k in keys:
        print(f"  many keys: {k:,} tenants x {per_key}, store on a cluster of {CLUSTER_MASTERS} ...", flush=True)
        masters, got = cluster_run(k, per_key)
        n = k * per_key
        total = Counts(*(sum(x) for x in zip(*(astuple(m) for m in masters))))
        shares = [m.commands / total.commands for m in masters]
        res.add(SEC, f"{k:,} keys x {per_key}, store on a cluster of {CLUSTER_MASTERS} masters: the most of the "
                     "store's commands one master takes", "celery_throttle", f"{max(shares):.2f} "
                f"({' / '.join(f'{x:.2f}' for x in shares)})", f"<= {MASTER_TARGET}",
                max(shares) <= MASTER_TARGET and bool(got["done"]),
                f"{total.commands / n:.1f} commands, {total.script_calls / n:.2f} script calls per task in all; "
                f"most starts of a tenant in any 1 s, by the bodies' notes: {got['most']:.0f} (limit {LIMIT})")
        for i, m in enumerate(masters):
            lines.append(f"| {k:,} | {i + 1} | {m.commands / total.commands:.2f} | {m.commands / n:.1f} | "
                         f"{m.script_calls / n:.2f} | {m.cpu_s / n * 1e6:.0f} |")
    res.table("many_keys", f"The store on a Redis Cluster of {CLUSTER_MASTERS} masters (loopback, no replicas), 2 "
                           f"workers x {PROCESSES}, the broker apart: each master's part\n\n" + md(
                               "| keys | master | share of the commands | commands/task | script calls/task "
                               "| CPU µs/task |", lines))


def script_ops(keys: int, per_key: int) -> tuple[int, Counter[str], Counter[str]]:
    """(tasks, script calls by operation, their server µs) of one throttled run, from the SLOWLOG. The window
    script's operation is its ARGV[2], the index's ``index:`` and its op; a line's sample and the controls'
    stamp are ``eval``, any other script (a pause, the journal's epoch) ``other``."""
    n, calls, us = keys * per_key, Counter[str](), Counter[str]()
    with redis_server("--slowlog-log-slower-than", "0", "--slowlog-max-len", str(200 * n)) as server, \
            running(new_prefix("keys-ops"), server, store=server.url, records=server.url, count=2,
                    concurrency=4) as group:
        client = redis.Redis(port=server.port)
        time.sleep(3.0)
        client.slowlog_reset()
        produce(group, {"task": "keys_limit", "count": n, "vary": [f"t{k}" for k in range(keys)], "runs": per_key})
        deadline = time.monotonic() + 600
        while group.started("keys") < n and time.monotonic() < deadline:
            time.sleep(0.2)
        for entry in client.slowlog_get(-1):
            parts = entry["command"].split(b" ")
            if parts[0] == b"EVALSHA" and len(parts) > 5:
                keys_n = int(parts[2])
                op = parts[4 + keys_n].decode(errors="replace")
                # (window.lua takes a key's 7 keys, or 8 with a share; index.lua the index's 2)
                name = op if keys_n >= 7 else f"index:{op}" if keys_n == 2 else "other"
            elif parts[0] == b"EVAL":
                name = "eval"
            else:
                continue
            calls[name] += 1
            us[name] += int(entry["duration"])
    return n, calls, us


def run_many_keys(res: Results, scale: Any = None, keys: tuple[int, ...] = KEYS, per_key: int = PER_KEY,
                  ops: bool = False, admitted: int = 0, processes: tuple[int, ...] = (PROCESSES,),
                  cluster: bool = False) -> None:
    rows = []
    for k in keys:
        for c in processes:
            print(f"  many keys: {k:,} tenants x {per_key}, 2 workers x {c} ...", flush=True)
            plain, ours = one_run("keys_plain", k, per_key, processes=c), one_run("keys_limit", k, per_key, processes=c)
            waiting = k * max(per_key - LIMIT, 0) / (k * per_key)  # (the share of tasks that wait)
            ratio = ours["makespan"] / plain["makespan"]
            for name, got in (("plain Celery", plain), ("celery_throttle", ours)):
                rows.append(f"| {k:,} | 2 x {c} | {name} | {got['sends']:.1f} | {got['makespan']:.1f} | "
                            f"{got['commands']:.1f} | {got['calls']:.2f} | {got['cpu_us']:.0f} | "
                            f"{got['workers_cpu_us']:.0f} | {got['most']:.0f} |"
                            f"{'' if got['done'] else ' NOT finished'}")
            extra_cmds = (ours["commands"] - plain["commands"]) / waiting if waiting else 0.0
            extra_calls = ours["calls"] / waiting if waiting else 0.0
            res.add(SEC, f"{k:,} keys x {per_key} at {LIMIT}/s, 2 workers x {c}: makespan / plain Celery's",
                    "celery_throttle", f"{ratio:.2f} ({ours['makespan']:.1f} s / {plain['makespan']:.1f} s)",
                    f"<= {MAKESPAN_TARGET}", ratio <= MAKESPAN_TARGET and bool(ours["done"]) and ours["most"] <= LIMIT,
                    f"most starts of a tenant in any 1 s: {ours['most']:.0f} (limit {LIMIT})")
            res.add(SEC, f"{k:,} keys x {per_key}, 2 workers x {c}: script calls; store commands beyond plain "
                         "Celery's, per waiting task", "celery_throttle", f"{extra_calls:.2f}; {extra_cmds:.1f}",
                    f"<= {CALLS_TARGET:.0f}; <= {COMMANDS_TARGET:.0f}",
                    extra_calls <= CALLS_TARGET and extra_cmds <= COMMANDS_TARGET)
    if admitted:
        lines = []
        for k in keys:
            for run in range(admitted):
                got = one_run("keys_limit", k, per_key, admitted=True)
                lines.append(f"| {k:,} | {run + 1} | {got['admitted']:.0f} | {got['most']:.0f} | {got['recorded']:.2f} |")
        res.table("many_keys", "The most starts of a tenant in any 1 s, as the store admitted them (the record) and as "
                               "the bodies noted them\n\n" + md("| keys | run | admitted by the store | the bodies' notes "
                                                                "| starts recorded / tasks |", lines))
    if ops:
        n, calls, us = script_ops(min(keys), per_key)
        res.table("many_keys", f"Script calls by operation, {min(keys):,} keys x {per_key} (SLOWLOG at 0 µs)\n\n" + md(
            "| operation | calls per task | server µs per call | server µs per task |",
            (f"| {op} | {c / n:.2f} | {us[op] / c:.0f} | {us[op] / n:.0f} |" for op, c in calls.most_common())))
    if cluster:
        cluster_rows(res, keys, per_key)
    res.table("many_keys", md("| keys | worker processes | client | producer's sends (s) | first send to last start (s) "
                              "| commands/task | script calls/task | server CPU µs/task | workers' CPU µs/task "
                              "| most starts of a tenant in 1 s |",
                              rows))


def main(argv: list[str] | None = None) -> int:
    from bench.__main__ import FULL

    p = argparse.ArgumentParser(prog="python -m bench.many_keys", description=__doc__.splitlines()[0])
    p.add_argument("--keys", default=",".join(map(str, KEYS)), help="tenants of each run, comma-separated")
    p.add_argument("--per-key", type=int, default=PER_KEY, help="tasks each tenant sends at once")
    p.add_argument("--ops", action="store_true", help="and the script calls by operation, at the fewest keys")
    p.add_argument("--processes", default=str(PROCESSES), help="prefork processes of each of the 2 workers, "
                   "comma-separated: a run (and a row) per number")
    p.add_argument("--admitted", type=int, default=0, metavar="RUNS",
                   help="and RUNS runs more of each size with the record on: the starts as the store admitted them")
    p.add_argument("--cluster", action="store_true", help="and the throttled runs with the store on a Redis Cluster "
                   f"of {CLUSTER_MASTERS} masters: each master's part")
    args = p.parse_args(argv)
    keys = tuple(int(k) for k in args.keys.split(","))
    processes = tuple(int(c) for c in args.processes.split(","))
    standalone("bench.many_keys", argv, FULL, True, ("many_keys", run_many_keys, keys, args.per_key, args.ops,
                                                          args.admitted, processes, args.cluster))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
