"""Section 45 (scripts, issue 45 item 3): what one script call costs the store, by operation, beside a floor.

Each operation is called ``CALLS`` times against a redis-server of its own, on its clock (TIME), and
timed by the server (SLOWLOG at 0 µs: the script's own time, no round trip):

- the floor: a fixed window counted in a hash on the server's clock, the least a global check does
  (fitting: counted; denied: read only);
- ``limits``' moving window (``MovingWindowRateLimiter.hit``), the peer most Celery users know;
- celery_throttle's window script (sliding, one rate): a check that fits (``acquire``), one denied
  with nothing in line (``acquire``: DENIED), one denied while its line holds ``LINE`` tasks, and
  the claim of a task released from a line (``claim``, its release not counted).

The targets are issue 45's: a fitting check at most 1.5x the floor's, a denied one and a claim at
most 2x the floor's fitting check.

With ``--against LUA_DIR`` (another checkout's ``celery_throttle/store/lua``: a git worktree of an
earlier commit), this tree's window scripts and those made from that folder instead, on one server,
old and new in turn call by call, per operation: the ratio of their medians (this machine's speed moves
between runs, and a change of a few per cent shows only when both see the same drift).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import redis

from bench.common import Results, md, standalone
from tests.harness import redis_server

SEC = "45 script cost"
#: Calls timed per operation and round, tasks waiting in the line of the "denied, with a line"
#: case, and rounds (each script's calls are the first on the server in one of them).
CALLS, LINE, ROUNDS = 2_000, 1_000, 3
FITTING_TARGET, DENIED_TARGET, CLAIM_TARGET = 1.5, 2.0, 2.0

#: The floor: one rate, a fixed window counted in a hash field named by the window's number, on the
#: server's clock. ARGV: limit, window (µs). 1 if counted, else 0.
FLOOR = """local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = tostring(math.floor(now / tonumber(ARGV[2])))
local n = tonumber(redis.call('HGET', KEYS[1], window) or '0')
if n >= tonumber(ARGV[1]) then return 0 end
redis.call('HINCRBY', KEYS[1], window, 1)
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) / 1000))
return 1"""


def timed(client: redis.Redis, calls: Callable[[], Any], token: bytes = b"") -> list[int]:
    """The server's µs of each EVALSHA that ``calls`` sends (naming ``token``, when given)."""
    client.slowlog_reset()
    calls()
    return [int(e["duration"]) for e in client.slowlog_get(-1)
            if e["command"].startswith(b"EVALSHA ") and token in e["command"]]


def floor_cost(client: redis.Redis) -> dict[str, list[int]]:
    script = client.register_script(FLOOR)
    client.delete("floor:fit", "floor:deny")
    out = {"fitting": timed(client, lambda: [script(keys=["floor:fit"], args=[10**9, 60_000_000]) for _ in range(CALLS)])}
    script(keys=["floor:deny"], args=[1, 3_600_000_000])
    out["denied"] = timed(client, lambda: [script(keys=["floor:deny"], args=[1, 3_600_000_000]) for _ in range(CALLS)])
    client.delete("floor:fit", "floor:deny")
    return out


def limits_cost(url: str, client: redis.Redis) -> dict[str, list[int]]:
    from limits import parse, storage, strategies

    limiter = strategies.MovingWindowRateLimiter(storage.RedisStorage(url))
    roomy, full = parse(f"{CALLS * 10}/hour"), parse("1/hour")
    out = {"fitting": timed(client, lambda: [limiter.hit(roomy, "fit") for _ in range(CALLS)])}
    limiter.hit(full, "deny")
    out["denied"] = timed(client, lambda: [limiter.hit(full, "deny") for _ in range(CALLS)])
    return out


def ours_cost(url: str, client: redis.Redis) -> dict[str, list[int]]:
    from celery_throttle.core.keys import state_key
    from celery_throttle.core.protocol import Code, Entry, WindowCall
    from celery_throttle.core.rates import parse_rate
    from celery_throttle.store.client import RedisStore

    store = RedisStore(url, "cost")
    out: dict[str, list[int]] = {}
    try:
        roomy = WindowCall("sliding", (parse_rate(f"{CALLS * 10}/h"),), 1, slack_us=10_000)
        fit = state_key("cost", "cost", "fit")
        out["fitting"] = timed(client, lambda: [store.acquire(fit, roomy) for _ in range(CALLS)])
        full = WindowCall("sliding", (parse_rate("1/h"),), 1, slack_us=10_000)
        denied = state_key("cost", "cost", "denied")
        store.acquire(denied, full)
        out["denied"] = timed(client, lambda: [store.acquire(denied, full) for _ in range(CALLS)])
        lined = state_key("cost", "cost", "lined")
        store.acquire(lined, full)
        for n in range(LINE):
            store.acquire(lined, full, entry=Entry(f"t{n}", b"x" * 300, f"t{n}", 0, 0, 8))
        out[f"denied, {LINE:,} in line"] = timed(client, lambda: [store.acquire(lined, full) for _ in range(CALLS)])
        # (A line that a rate of 500/s releases: each released task is claimed at once.)
        pace = WindowCall("sliding", (parse_rate("500/s"),), 1, slack_us=10_000)
        claimed = state_key("cost", "cost", "claimed")
        for n in range(CALLS + 500):
            store.acquire(claimed, pace, entry=Entry(f"c{n}", b"x" * 300, f"c{n}", 0, 0, 8))

        def claims() -> None:
            done = 0
            while done < CALLS:
                reply = store.release(claimed, pace, 64)
                for r in reply.reported:
                    code = store.claim(claimed, pace, r.id, early_us=1_000_000, holder=f"h{r.id}").code
                    assert code in (Code.RUN, Code.RUN_AT), code
                    done += 1
                if not reply.reported:
                    time.sleep(0.002)

        out["claim of a released task"] = timed(client, claims, b" claim ")
    finally:
        for k in client.scan_iter(match="cost:*", count=1000):
            client.delete(k)
        store.close()
    return out


def measure() -> dict[str, dict[str, list[int]]]:
    """Each script's durations over ``ROUNDS`` rounds, each script first in one of them (the
    first calls on a fresh server run slower)."""
    with redis_server("--slowlog-log-slower-than", "0", "--slowlog-max-len", str(4 * CALLS)) as server:
        client = redis.Redis(port=server.port, socket_timeout=120)
        runs: dict[str, Callable[[], dict[str, list[int]]]] = {
            "floor": lambda: floor_cost(client), "limits": lambda: limits_cost(server.url, client),
            "celery_throttle": lambda: ours_cost(server.url, client)}
        got: dict[str, dict[str, list[int]]] = {who: {} for who in runs}
        order = list(runs)
        for n in range(ROUNDS):
            for who in order[n % len(order):] + order[:n % len(order)]:
                for op, durations in runs[who]().items():
                    got[who].setdefault(op, []).extend(durations)
        return got


def run_scripts(res: Results, scale: Any = None) -> None:
    got = measure()
    floor = statistics.median(got["floor"]["fitting"])
    rows = []
    for who, ops in got.items():
        for op, durations in ops.items():
            median = statistics.median(durations)
            rows.append(f"| {who} | {op} | {median:.1f} | {statistics.mean(durations):.1f} | {median / floor:.2f} |")
    res.table("scripts", md("| script | operation | µs per call, median | mean | / the floor's fitting check |", rows))
    ours = got["celery_throttle"]
    for op, target in (("fitting", FITTING_TARGET), ("denied", DENIED_TARGET),
                       (f"denied, {LINE:,} in line", DENIED_TARGET), ("claim of a released task", CLAIM_TARGET)):
        ratio = statistics.median(ours[op]) / floor
        res.add(SEC, f"script µs per call / the floor's fitting check: {op}", "celery_throttle", f"{ratio:.2f}",
                f"<= {target}x", ratio <= target, f"median {statistics.median(ours[op]):.1f} µs, floor {floor:.1f} µs")
    for op in ("fitting", "denied"):
        res.add(SEC, f"script µs per call / the floor's fitting check: {op}", "limits moving window",
                f"{statistics.median(got['limits'][op]) / floor:.2f}", judged=False)


#: The operations the side-by-side run times, each ``AGAINST_CALLS`` times a round, old and new in turn.
AGAINST_CALLS, AGAINST_ROUNDS = 1_500, 2


def against(lua_dir: str) -> dict[tuple[str, str], list[int]]:
    """The server's µs of each call of the window scripts made from ``lua_dir`` (another checkout's
    ``celery_throttle/store/lua``: "old") and of this tree's ("new"), one server, the two in turn call by
    call, so that the machine's drift falls on both: a fitting check, a denial on an empty line, an admit
    into a line, and the releases and claims of a line released at 500/s. (The scripts' arguments and
    replies must be this tree's.)"""
    import hashlib
    from pathlib import Path

    from celery_throttle.core.keys import state_key
    from celery_throttle.core.protocol import Entry, WindowCall
    from celery_throttle.core.rates import parse_rate
    from celery_throttle.store import compose, window
    from celery_throttle.store.client import RedisStore

    here, old_sha, got = compose.lua, set(), {}

    def made_from(store: RedisStore, old: bool) -> None:
        def wrap(maker: Callable[[], tuple[str, Any]]) -> Callable[[], tuple[str, Any]]:
            def make() -> tuple[str, Any]:
                window._window_script.cache_clear()  # (made once per process: once per tree here)
                compose.lua = (lambda name: (Path(lua_dir) / name).read_text("utf-8")) if old else here
                try:
                    source, lines = maker()
                finally:
                    compose.lua = here
                    window._window_script.cache_clear()
                if old:
                    old_sha.add(hashlib.sha1(source.encode()).hexdigest().encode())
                return source, lines
            return make
        store._makers = {name: wrap(maker) for name, maker in store._makers.items()}

    def collect(client: redis.Redis, label: str | None = None) -> None:
        for e in client.slowlog_get(-1):
            parts = e["command"].split(b" ")
            if parts[0] == b"EVALSHA":
                op = label or parts[3 + int(parts[2]) + 1].decode()  # (ARGV[2], after the keys and ARGV[1])
                got.setdefault((op, "old" if parts[1] in old_sha else "new"), []).append(int(e["duration"]))
        client.slowlog_reset()

    with redis_server("--slowlog-log-slower-than", "0", "--slowlog-max-len", str(8 * AGAINST_CALLS)) as server:
        client = redis.Redis(port=server.port, socket_timeout=120)
        # (One clock for both, moved by the run: a release at a moment releases as much for each.)
        clock = [time.time_ns() // 1000]

        def now_us() -> int:
            clock[0] += 100
            return clock[0]

        stores = {"old": RedisStore(server.url, "old", clock=now_us), "new": RedisStore(server.url, "new", clock=now_us)}
        for who, store in stores.items():
            made_from(store, who == "old")
        slow, full = (WindowCall("sliding", (parse_rate(r),), 1, slack_us=10_000) for r in ("5/s", "1/h"))
        roomy = WindowCall("sliding", (parse_rate(f"{AGAINST_CALLS * 10}/h"),), 1, slack_us=10_000)
        pace = WindowCall("sliding", (parse_rate("500/s"),), 1, slack_us=10_000)
        try:
            for n in range(AGAINST_ROUNDS):
                order = list(stores.items())[::1 if n % 2 == 0 else -1]
                keys = {who: {k: state_key(who, who, f"{k}{n}") for k in ("fit", "den", "line", "cl")} for who in stores}
                for who, store in order:
                    store.acquire(keys[who]["den"], full)
                    for i in range(10):
                        store.admit(keys[who]["line"], slow, Entry(f"w{i}", b"x" * 600, f"w{i}", 0, 0, 8))
                    for i in range(AGAINST_CALLS + 700):  # (500 start, the rest wait)
                        store.acquire(keys[who]["cl"], pace, entry=Entry(f"c{i}", b"x" * 300, f"c{i}", 0, 0, 8))
                client.slowlog_reset()
                for label, call in (("fitting", lambda who, st, i: st.acquire(keys[who]["fit"], roomy)),
                                    ("denied, nothing in line", lambda who, st, i: st.acquire(keys[who]["den"], full)),
                                    ("admit into a line", lambda who, st, i: st.admit(
                                        keys[who]["line"], slow, Entry(f"a{i}", b"x" * 600, f"a{i}", 0, 0, 8)))):
                    for i in range(AGAINST_CALLS):
                        for who, store in order:
                            call(who, store, i)
                    collect(client, label)
                done = dict.fromkeys(stores, 0)
                while min(done.values()) < AGAINST_CALLS:
                    for who, store in order:
                        for r in store.release(keys[who]["cl"], pace, 64).reported:
                            store.claim(keys[who]["cl"], pace, r.id, early_us=1_000_000, holder=f"h{r.id}")
                            done[who] += 1
                    clock[0] += 2_000
                collect(client)
        finally:
            for who in stores:
                for k in client.scan_iter(match=f"{who}:*", count=1000):
                    client.delete(k)
            for store in stores.values():
                store.close()
    return got


def checkout_of(lua_dir: str) -> str:
    """What names the checkout of ``lua_dir``: its commit, else the folder's name."""
    import subprocess

    done = subprocess.run(["git", "-C", lua_dir, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False)
    return f"`{done.stdout.strip()}`" if done.returncode == 0 else os.path.basename(os.path.normpath(lua_dir))


def run_against(res: Results, scale: Any, lua_dir: str) -> None:
    got, rows, old_name = against(lua_dir), [], checkout_of(lua_dir)
    # (one clock for both: a release sends as many tasks for each)
    for op in ("fitting", "denied, nothing in line", "admit into a line", "release", "claim"):
        old, new = (got.get((op, who)) for who in ("old", "new"))
        if old and new and statistics.median(old) > 0:
            ratio = statistics.median(new) / statistics.median(old)
            rows.append(f"| {op} | {statistics.median(old):.1f} | {statistics.median(new):.1f} | {ratio:.2f} |")
            res.add(SEC, f"script µs per call, this tree / {old_name}'s: {op}", "celery_throttle", f"{ratio:.2f}",
                    judged=False)
    res.table("scripts_against", f"This tree's window scripts against {old_name}'s, call by call on one server "
                         f"({AGAINST_ROUNDS} rounds of {AGAINST_CALLS:,} calls each)\n\n" + md(
                             "| operation | old µs per call, median | new | new / old |", rows))


def main(argv: list[str] | None = None) -> int:
    from bench.__main__ import FULL

    p = argparse.ArgumentParser(prog="python -m bench.scripts", description=__doc__.splitlines()[0])
    p.add_argument("--against", metavar="LUA_DIR", help="time this tree's window scripts against those made from "
                   "another checkout's celery_throttle/store/lua (a git worktree of an earlier commit), in turn")
    args = p.parse_args(argv)
    if args.against:
        standalone("bench.scripts", argv, FULL, True, ("scripts_against", run_against, args.against))
    else:
        standalone("bench.scripts", argv, FULL, True, ("scripts", run_scripts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
