"""The window script's own cost per operation, side by side with another revision's.

    python -m bench.script_ops [REV]     # REV: the revision to compare with (default HEAD~1)

On a redis-server of its own (a free loopback port; no other client disturbs its
counters), the server-side µs per EVALSHA (``INFO commandstats``) of the sliding window
script of this tree and of REV, in turns, 7 rounds of 2 000 calls each (the least: a
busy machine only adds), for:
an acquire that fits (the fast path), an acquire denied that reserves (the general
path), a peek of a full key, and an admit that fits; and the floor of a check that reads
and writes the hash: TIME + HMGET + HSET in one script. Then a reserving denial behind
backlogs of 0 to 100 000 starts reserved already.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable

import redis

from celery_throttle.protocol import WindowCall, window_argv
from celery_throttle.rates import parse_rates
from celery_throttle.store import window_preamble, window_script
from examples.local_redis import start

ROUNDS, CALLS = 7, 2000
#: Backlogs (starts reserved already) a reserving denial is measured behind.
DEPTHS, DEEP_CALLS = (0, 1_000, 10_000, 100_000), 500
FLOOR = ("local t = redis.call('TIME') local v = redis.call('HMGET', KEYS[1], 'e', 'd', 'v', 'f', ARGV[1]) "
         "redis.call('HSET', KEYS[1], ARGV[1], t[2]) return 1")


def script_at(rev: str, algorithm: str) -> str:
    """The window script of ``rev``, loaded with today's constants (a constant it does not
    read costs nothing)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout

    return window_preamble() + show(f"celery_throttle/lua/{algorithm}.lua") + show("celery_throttle/lua/window.lua")


def per_call(client: redis.Redis, sha: str, key: str, args: list[int | str]) -> float:
    client.config_resetstat()
    for _ in range(CALLS):
        client.evalsha(sha, 1, key, *args)
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def main(argv: list[str]) -> int:
    rev = argv[0] if argv else "HEAD~1"
    server = start()
    client = redis.Redis(port=server.port)
    try:
        shas = {"this tree": client.script_load(window_script("sliding")),
                rev: client.script_load(script_at(rev, "sliding"))}
        floor = client.script_load(FLOOR)
        roomy, full = tuple(parse_rates(["1000000/s"])), tuple(parse_rates(["1/h"]))
        cases: dict[str, Callable[[str], tuple[str, list[int | str]]]] = {}

        def fresh(op: str, call: WindowCall, reserve: bool = False) -> Callable[[str], tuple[str, list[int | str]]]:
            def make(sha: str) -> tuple[str, list[int | str]]:
                key = f"k:{uuid.uuid4().hex}"
                if call.rates == full:  # (spent first: every call then finds it full)
                    client.evalsha(sha, 1, key, *window_argv("", "acquire", WindowCall("sliding", full)))
                return key, window_argv("", op, call, reserve=reserve)
            return make

        cases["acquire that fits (fast path)"] = fresh("acquire", WindowCall("sliding", roomy, slack_us=2000))
        cases["acquire denied, reserving"] = fresh("acquire", WindowCall("sliding", full, grace_us=10_000), True)
        cases["peek of a full key"] = fresh("peek", WindowCall("sliding", full))
        cases["admit that fits"] = fresh("admit", WindowCall("sliding", roomy, slack_us=2000))
        times: dict[tuple[str, str], list[float]] = {}
        floors = []
        for _ in range(ROUNDS):
            floors.append(per_call(client, floor, "floor", ["s1000000/1000000"]))
            for label, make in cases.items():
                for name, sha in shas.items():
                    key, args = make(sha)
                    times.setdefault((label, name), []).append(per_call(client, sha, key, args))
        # A reserving denial behind a backlog of DEPTHS starts reserved already (each row's
        # key filled first, the two scripts in turns): how the general path grows with it.
        deep: dict[tuple[int, str], list[float]] = {}
        busy = tuple(parse_rates(["100/s"]))
        reserving = WindowCall("sliding", busy, grace_us=10_000)
        for depth in DEPTHS:
            for _ in range(3):
                for name, sha in shas.items():
                    key = f"d:{uuid.uuid4().hex}"
                    pipe = client.pipeline(transaction=False)
                    for _ in range(depth):
                        pipe.evalsha(sha, 1, key, *window_argv("", "acquire", reserving, reserve=True))
                    pipe.execute()
                    client.config_resetstat()
                    for _ in range(DEEP_CALLS):
                        client.evalsha(sha, 1, key, *window_argv("", "acquire", reserving, reserve=True))
                    deep.setdefault((depth, name), []).append(
                        float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]))
        base = min(floors)
        print(f"server-side µs per call, least of {ROUNDS} rounds of {CALLS}; floor (TIME+HMGET+HSET) {base:.1f} µs")
        print(f"{'operation':32s} {rev:>10s} {'this tree':>10s}  ratio  / floor")
        for label in cases:
            old, new = min(times[(label, rev)]), min(times[(label, "this tree")])
            print(f"{label:32s} {old:10.1f} {new:10.1f}  {new / old:5.2f}  {new / base:5.2f}")
        print(f"a reserving denial of a 100/s key, behind a backlog (least of 3 x {DEEP_CALLS} calls):")
        for depth in DEPTHS:
            old, new = min(deep[(depth, rev)]), min(deep[(depth, "this tree")])
            print(f"{f'  {depth} reserved already':32s} {old:10.1f} {new:10.1f}  {new / old:5.2f}  {new / base:5.2f}")
    finally:
        client.close()
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
