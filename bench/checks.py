"""Section 5: what one check costs, single client, against the local Redis.

Every limiter runs under a limit it never reaches (1,000,000/s), so each call is the
common "allowed" path. Each variant runs for a fixed time per round; rounds are
interleaved and the best round is kept (the machine is shared). Latency is per call; for
the 10-key pipelined rows it is per pipeline of 10. "Redis CPU" is the CPU time of the
server's main thread per check (INFO cpu: commands, scripts and socket I/O), the least
over the rounds: other clients of the shared server add to it. "Script" is EVALSHA's own
time per call (INFO commandstats), the least over the rounds: the fitting check against a
floor script doing only TIME + HMGET + HSET + PEXPIRE on one hash (issue #15: at most
FIT_FLOOR_TARGET times it), and ctl.acquire against ``limits`` on the same algorithm (at
least LIMITS_TARGET times its checks/s). Run it on a Redis of its own
(``CB_REDIS_PORT``): another client's scripts count in EVALSHA's time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

import celery_throttle
from bench.bulk import Bulk, supported
from bench.common import STORE_URL, Results, fmt_num, limits_peers, percentile
from celery_throttle.core.keys import state_key
from celery_throttle.core.protocol import WindowCall
from celery_throttle.core.rates import Rate

RATE = "1000000/s"
INCR_LUA = "return redis.call('INCR', KEYS[1])"
#: The least a fitting check's script can do: read the clock, read the state, write it,
#: keep it alive (the fields a check of one rate reads).
FLOOR_LUA = """local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local stored = redis.call('HMGET', KEYS[1], 'e', 'd', 'v', 'f')
redis.call('HSET', KEYS[1], 'f', string.format('%.0f', now), 'e', '1')
redis.call('PEXPIRE', KEYS[1], 2000)
return now"""
FLOOR_NAME = "EVALSHA TIME+HMGET+HSET+PEXPIRE (script floor)"
#: Issue #15's targets: a fitting check's script time at most this many times the floor
#: script's, and ctl.acquire at least this share of limits' checks/s, same algorithm.
FIT_FLOOR_TARGET, LIMITS_TARGET = 1.5, 0.9
#: The limits strategy of each of our algorithms (the same decision: an exact sliding
#: window, an aligned fixed one).
LIMITS_PEER = {"sliding": "limits MovingWindow", "fixed": "limits FixedWindow"}
KEYS10 = [f"k{i}" for i in range(10)]


@dataclass
class Stat:
    """Throughput and latency of one variant's best round."""

    per_s: float
    p50_us: float
    p99_us: float
    calls: int
    #: Redis CPU per check (µs): the server's main thread during the round (INFO cpu),
    #: so other clients of the server add a little.
    server_us: float = float("nan")
    #: EVALSHA's own time per call (µs; INFO commandstats), NaN for a variant without.
    script_us: float = float("nan")


def _server_usec(client: Any) -> float:
    """CPU time of Redis' main thread (µs): commands, scripts and socket I/O alike.

    (INFO commandstats would miss the I/O, and counts a script's inner commands twice:
    once in EVALSHA's time, once as themselves.)
    """
    cpu = client.info("cpu")
    return (float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])) * 1e6


def _evalsha_usec(client: Any) -> tuple[int, int]:
    """(calls, µs) of EVALSHA so far (INFO commandstats)."""
    stat = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stat.get("calls", 0)), int(stat.get("usec", 0))


def measure(fn: Callable[[], Any], seconds: float, per_call: int = 1, max_calls: int = 2_000_000,
            stats_client: Any = None) -> Stat:
    """Call ``fn`` for ``seconds`` (or ``max_calls`` times); each call does ``per_call`` checks."""
    for _ in range(50):  # warm up: connections, script loads
        fn()
    usec0 = _server_usec(stats_client) if stats_client is not None else 0
    evalsha0 = _evalsha_usec(stats_client) if stats_client is not None else (0, 0)
    lat: list[int] = []
    clock = time.perf_counter_ns
    start = clock()
    end = start + int(seconds * 1e9)
    n = 0
    while n < max_calls:
        t0 = clock()
        fn()
        t1 = clock()
        lat.append(t1 - t0)
        n += 1
        if t1 >= end:
            break
    elapsed = (clock() - start) / 1e9
    server = script = float("nan")
    if stats_client is not None:
        server = (_server_usec(stats_client) - usec0) / (n * per_call)
        calls, usec = _evalsha_usec(stats_client)
        if calls - evalsha0[0] >= n * per_call:  # (a variant without scripts has none)
            script = (usec - evalsha0[1]) / (calls - evalsha0[0])
    lat.sort()
    return Stat(n * per_call / elapsed, percentile(lat, 0.5) / 1000, percentile(lat, 0.99) / 1000,
                n * per_call, server, script)


def _variants(prefix: str) -> list[tuple[str, str, str, Callable[[], Any], int]]:
    """(name, family, group, callable, checks per call) for every variant available."""
    out: list[tuple[str, str, str, Callable[[], Any], int]] = []
    client = redis.Redis.from_url(STORE_URL)
    # The floor calls EVALSHA as directly as redis-py allows (no Script object), as the
    # store does.
    incr_sha = client.script_load(INCR_LUA)
    out.append(("redis PING", "ping", "ref", client.ping, 1))
    out.append(("EVALSHA INCR (floor)", "floor", "ref", lambda: client.evalsha(incr_sha, 1, f"{prefix}:floor"), 1))
    floor_sha = client.script_load(FLOOR_LUA)
    out.append((FLOOR_NAME, "floor", "ref",
                lambda: client.evalsha(floor_sha, 1, f"{prefix}:script-floor"), 1))

    app = Celery("bench-cost", broker=STORE_URL, set_as_current=False)
    app.conf.update(throttle_redis_url=STORE_URL, throttle_key_prefix=prefix)
    ctl = celery_throttle.install(app)
    rate = Rate(1_000_000, 1.0)
    for algo in ("sliding", "fixed"):
        out.append((f"ours {algo}: ctl.acquire", algo, "ours",
                    lambda a=algo: ctl.acquire("cost", key=f"acq-{a}", rates=RATE, algorithm=a), 1))
        key = state_key(prefix, "cost", f"win-{algo}")
        out.append((f"ours {algo}: store.acquire", algo, "ours",
                    lambda a=algo, k=key: ctl.store.acquire(k, WindowCall(a, (rate,), 1)), 1))

    out += [(name, family, "peer", hit, 1) for name, family, hit in limits_peers(STORE_URL, prefix)]
    try:
        from throttled import RedisStore, Throttled, rate_limiter

        store = RedisStore(server=STORE_URL)
        for name, family, using in (("throttled-py fixed_window", "fixed", "fixed_window"),
                                    ("throttled-py sliding_window", "sliding", "sliding_window"),
                                    ("throttled-py gcra", "gcra", "gcra")):
            thr = Throttled(using=using, quota=rate_limiter.per_sec(1_000_000), store=store,
                            key_prefix=f"{prefix}-throttled")
            out.append((name, family, "peer", lambda t=thr: t.limit("k"), 1))
    except ImportError:
        pass

    # Ten keys per round trip, where the API allows it.
    pipe = client.pipeline(transaction=False)

    def floor10() -> None:
        for k in KEYS10:
            pipe.evalsha(incr_sha, 1, f"{prefix}:floor:{k}")
        pipe.execute()

    out.append(("EVALSHA INCR (floor), 10 keys pipelined", "floor", "ref10", floor10, 10))
    if supported(ctl.store):
        for algo in ("sliding", "fixed"):
            keys = [state_key(prefix, "cost10", f"{algo}-{k}") for k in KEYS10]

            def ours10(a: str = algo, ks: list[str] = keys) -> None:
                with Bulk(ctl.store, batch=10):
                    for k in ks:
                        ctl.store.acquire(k, WindowCall(a, (rate,), 1))

            out.append((f"ours {algo}: store.acquire, 10 keys pipelined", algo, "ours10", ours10, 10))
    return out


def run_checks(res: Results, prefix: str, seconds: float, rounds: int) -> None:
    """Measure every variant, then add the section-5 rows."""
    variants = _variants(prefix)
    stats_client = redis.Redis.from_url(STORE_URL)
    best: dict[str, Stat] = {}
    server: dict[str, float] = {}
    script: dict[str, float] = {}
    for r in range(rounds):
        for name, _, _, fn, per_call in (variants if r % 2 == 0 else variants[::-1]):
            try:
                stat = measure(fn, seconds, per_call, stats_client=stats_client)
            except Exception as exc:  # a peer library failing must not stop the bench
                res.notes.append(f"check cost: {name} failed: {exc!r}")
                continue
            if name not in best or stat.per_s > best[name].per_s:
                best[name] = stat
            if stat.server_us >= 0:  # negative: someone reset the server's stats meanwhile
                server[name] = min(server.get(name, float("inf")), stat.server_us)
            if stat.script_us >= 0:
                script[name] = min(script.get(name, float("inf")), stat.script_us)
    for name, stat in best.items():
        stat.server_us = server.get(name, float("nan"))
        stat.script_us = script.get(name, float("nan"))
    sec = "5 check cost"
    for name, family, group, _, _ in variants:
        if name not in best:
            continue
        s = best[name]
        value = f"{fmt_num(s.per_s, 0)}/s (p50 {s.p50_us:.0f} µs, p99 {s.p99_us:.0f} µs)"
        note = [f"Redis CPU {s.server_us:.1f} µs/check"] if s.server_us == s.server_us else []
        note += [f"script {s.script_us:.1f} µs/call"] if s.script_us == s.script_us else []
        res.add(sec, "checks/s, 1 client", name, value, "", None, ", ".join(note))
    floor = best.get("EVALSHA INCR (floor)")
    floor10 = best.get("EVALSHA INCR (floor), 10 keys pipelined")
    for name, family, group, _, _ in variants:
        s = best.get(name)
        if s is None or not group.startswith("ours"):
            continue
        ref = floor10 if group == "ours10" else floor
        if ref:
            ratio = s.per_s / ref.per_s
            res.add(sec, "ours / EVALSHA floor", name, f"{ratio:.2f}x", ">= 0.95x", ratio >= 0.95)
        if group == "ours":
            peers = [(n, best[n]) for n, f, g, _, _ in variants if g == "peer" and f == family and n in best]
            if peers:
                peer_name, peer = max(peers, key=lambda p: p[1].per_s)
                ratio = s.per_s / peer.per_s
                res.add(sec, "ours / best peer, same algorithm", name, f"{ratio:.2f}x",
                        ">= 1.00x", ratio >= 1.0, f"best peer: {peer_name}")
    _fit_rows(res, sec, best)
    res.notes.append("Check cost: limits and throttled-py have no pipelined/batch API, so only the "
                     "EVALSHA floor and celery_throttle's script (through bench/bulk.py) run 10 keys "
                     "per round trip.")
    res.series["checks"] = {k: vars(v) for k, v in best.items()}


def _fit_rows(res: Results, sec: str, best: dict[str, Stat]) -> None:
    """Issue #15's two targets for a fitting check, per algorithm: its script time against
    the floor script's, and ctl.acquire's checks/s against limits' (same run)."""
    floor = best.get(FLOOR_NAME)
    for algo in ("sliding", "fixed"):
        ours, direct = best.get(f"ours {algo}: store.acquire"), best.get(f"ours {algo}: ctl.acquire")
        if floor is not None and ours is not None and floor.script_us > 0:
            ratio = ours.script_us / floor.script_us
            res.add(sec, "script µs of a fitting check / floor script", f"ours {algo}",
                    f"{ratio:.2f}x ({ours.script_us:.1f} µs / {floor.script_us:.1f} µs)",
                    f"<= {FIT_FLOOR_TARGET:.2f}x", ratio <= FIT_FLOOR_TARGET, "floor: TIME+HMGET+HSET+PEXPIRE")
        peer = best.get(LIMITS_PEER[algo])
        if direct is not None and peer is not None:
            ratio = direct.per_s / peer.per_s
            res.add(sec, "ctl.acquire checks/s / limits, same algorithm", f"ours {algo}",
                    f"{ratio:.2f}x ({fmt_num(direct.per_s, 0)}/s / {fmt_num(peer.per_s, 0)}/s)",
                    f">= {LIMITS_TARGET:.2f}x", ratio >= LIMITS_TARGET,
                    f"{LIMITS_PEER[algo]}; script {direct.script_us:.1f} µs vs {peer.script_us:.1f} µs")
