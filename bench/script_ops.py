"""The window script's own cost per operation, side by side with another revision's.

    python -m bench.script_ops [REV]     # REV: the revision to compare with (default HEAD~1)

On a redis-server of its own (a free loopback port; no other client disturbs its
counters), the server-side µs per EVALSHA (``INFO commandstats``) of the sliding window
script of this tree and of REV, in turns, 7 rounds of 2 000 calls each (the least: a
busy machine only adds), each script called with the ARGV its own revision builds (REV's
``protocol.py``, imported from a copy of its package) and checked once for the code it
must answer, for:
an acquire that fits (the fast path), an acquire denied that reserves (the general
path), a peek of a full key, and an admit that fits; and the floor of a check that reads
and writes the hash: TIME + HMGET + HSET in one script. Then a reserving denial behind
backlogs of 0 to 100 000 starts reserved already.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

from celery_throttle.core import protocol
from celery_throttle.store.window import window_preamble, window_script
from examples.local_redis import start

ROUNDS, CALLS = 7, 2000
#: Backlogs (starts reserved already) a reserving denial is measured behind.
DEPTHS, DEEP_CALLS = (0, 1_000, 10_000, 100_000), 500
FLOOR = ("local t = redis.call('TIME') local v = redis.call('HMGET', KEYS[1], 'e', 'd', 'v', 'f', ARGV[1]) "
         "redis.call('HSET', KEYS[1], ARGV[1], t[2]) return 1")


def script_at(rev: str, algorithm: str) -> str:
    """The window script of ``rev``, loaded with today's constants (a constant it does not
    read costs nothing)."""
    def show(name: str) -> str:
        # (The scripts moved to store/lua/ with the folders; older revisions have them in lua/.)
        for folder in ("celery_throttle/store/lua", "celery_throttle/lua"):
            found = subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], capture_output=True, text=True)
            if found.returncode == 0:
                return found.stdout
        raise FileNotFoundError(f"{name} at {rev}")

    return window_preamble() + show(f"{algorithm}.lua") + show("window.lua")


def protocol_at(rev: str, into: Path) -> ModuleType:
    """``celery_throttle.core.protocol`` as ``rev`` has it (a copy of its package, imported under
    another name): each script is called with the ARGV its own revision builds, since the
    order of the arguments changes between revisions."""
    name = f"celery_throttle_at_{subprocess.run(['git', 'rev-parse', '--short', rev], capture_output=True, text=True, check=True).stdout.strip()}"
    archive = subprocess.run(["git", "archive", rev, "celery_throttle"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "celery_throttle").rename(into / name)
    sys.path.insert(0, str(into))
    # (The module moved into core/ with the folders; older revisions have it at the top.)
    folder = "core." if (into / name / "core" / "protocol.py").exists() else ""
    return importlib.import_module(f"{name}.{folder}protocol")


def per_call(client: redis.Redis, sha: str, key: str, args: list[Any]) -> float:
    client.config_resetstat()
    for _ in range(CALLS):
        client.evalsha(sha, 1, key, *args)
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


class Side:
    """One revision's window script and the protocol that calls it."""

    def __init__(self, client: redis.Redis, script: str, proto: ModuleType) -> None:
        self.client, self.proto = client, proto
        self.sha = client.script_load(script)
        self.roomy = (proto.Rate(1_000_000, 1.0),)
        self.full = (proto.Rate(1, 3600.0),)

    def argv(self, op: str, rates: tuple[Any, ...], reserve: bool = False, **call: int) -> list[Any]:
        return list(self.proto.window_argv("", op, self.proto.WindowCall("sliding", rates, **call), reserve=reserve))

    def case(self, op: str, full: bool, reserve: bool, expect: str, **call: int) -> tuple[str, list[Any]]:
        """A fresh key (spent first if ``full``) and the ARGV of ``op`` on it, checked once:
        the reply's code must be ``expect`` (a revision whose ARGV is not the one its script
        reads would be timed failing, fast)."""
        key = f"k:{uuid.uuid4().hex}"
        rates = self.full if full else self.roomy
        if full:
            self.client.evalsha(self.sha, 1, key, *self.argv("acquire", rates))
        args = self.argv(op, rates, reserve, **call)
        probe = f"probe:{uuid.uuid4().hex}"
        if full:
            self.client.evalsha(self.sha, 1, probe, *self.argv("acquire", rates))
        code = int(self.client.evalsha(self.sha, 1, probe, *args)[0])
        codes = self.proto.Code
        wanted = getattr(codes, expect, codes.DENIED)  # (before RESERVED, a reserving denial was DENIED)
        if code != wanted:
            raise SystemExit(f"{op} answered code {code}, not {expect}: the script and its ARGV disagree")
        return key, args


def main(argv: list[str]) -> int:
    rev = argv[0] if argv else "HEAD~1"
    server = start()
    client = redis.Redis(port=server.port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sides = {"this tree": Side(client, window_script("sliding"), protocol),
                     rev: Side(client, script_at(rev, "sliding"), protocol_at(rev, Path(tmp)))}
            return _measure(client, rev, sides)
    finally:
        client.close()
        server.stop()


#: Each operation timed: (op, spent first, reserve, the code it must answer, the call's fields).
CASES: dict[str, tuple[str, bool, bool, str, dict[str, int]]] = {
    "acquire that fits (fast path)": ("acquire", False, False, "RUN", {"slack_us": 2000}),
    "acquire denied, reserving": ("acquire", True, True, "RESERVED", {"grace_us": 10_000}),
    "peek of a full key": ("peek", True, False, "DENIED", {}),
    "admit that fits": ("admit", False, False, "RUN", {"slack_us": 2000}),
}


def _measure(client: redis.Redis, rev: str, sides: dict[str, Side]) -> int:
    floor = client.script_load(FLOOR)
    times: dict[tuple[str, str], list[float]] = {}
    floors = []
    for _ in range(ROUNDS):
        floors.append(per_call(client, floor, "floor", ["s1000000/1000000"]))
        for label, (op, full, reserve, expect, call) in CASES.items():
            for name, side in sides.items():
                key, args = side.case(op, full, reserve, expect, **call)
                times.setdefault((label, name), []).append(per_call(client, side.sha, key, args))
    # A reserving denial behind a backlog of DEPTHS starts reserved already (each row's
    # key filled first, the two scripts in turns): how the general path grows with it.
    deep: dict[tuple[int, str], list[float]] = {}
    for depth in DEPTHS:
        for _ in range(3):
            for name, side in sides.items():
                busy = (side.proto.Rate(100, 1.0),)
                args = side.argv("acquire", busy, True, grace_us=10_000)
                key = f"d:{uuid.uuid4().hex}"
                pipe = client.pipeline(transaction=False)
                for _ in range(depth):
                    pipe.evalsha(side.sha, 1, key, *args)
                pipe.execute()
                client.config_resetstat()
                for _ in range(DEEP_CALLS):
                    client.evalsha(side.sha, 1, key, *args)
                deep.setdefault((depth, name), []).append(
                    float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]))
    base = min(floors)
    print(f"server-side µs per call, least of {ROUNDS} rounds of {CALLS}; floor (TIME+HMGET+HSET) {base:.1f} µs")
    print(f"{'operation':32s} {rev:>10s} {'this tree':>10s}  ratio  / floor")
    for label in CASES:
        old, new = min(times[(label, rev)]), min(times[(label, "this tree")])
        print(f"{label:32s} {old:10.1f} {new:10.1f}  {new / old:5.2f}  {new / base:5.2f}")
    print(f"a reserving denial of a 100/s key, behind a backlog (least of 3 x {DEEP_CALLS} calls):")
    for depth in DEPTHS:
        old, new = min(deep[(depth, rev)]), min(deep[(depth, "this tree")])
        print(f"{f'  {depth} reserved already':32s} {old:10.1f} {new:10.1f}  {new / old:5.2f}  {new / base:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
