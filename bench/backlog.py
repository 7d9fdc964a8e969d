"""Section 9: what a deep backlog costs, and the fitting call against peers.

A key whose quota is spent gathers one reserved start per denied task: tens of thousands
for a flood. Its checks must cost what they cost with one reservation, and its state
must stay small. Everything here runs on a redis-server of its own, started on a free
loopback port for the section and stopped after it, so its ``INFO commandstats``
(EVALSHA ``usec`` / ``calls``: script time per call, in Redis) and its ``SLOWLOG`` (every
call, with its duration) are ours to reset and read:

* :func:`run_backlog_store`: ``RedisStore.window`` called directly against the real clock
  (Redis TIME), for sliding and fixed, rates ``1/s`` and ``10/s + 1000/h``, at 1, 1 000,
  10 000 and 100 000 reservations outstanding on one key (made by pipelined acquire
  calls with ``reserve=True``, as the worker's do). At each depth: denials (each adds a
  reservation); on-time claims of the front reservations (the worker's claim of a task
  that arrives at its start: each call passes that start + 0.5 ms as the script's "now",
  the one thing here not read from Redis TIME, instead of waiting for it, which at 1/s
  would take a second per claim); claims of a far-off reservation (code 2, "early",
  real clock); the slowest call; the key's bytes. Depth 1 uses one key per measured
  call, so every call sees exactly one reservation. The naive limiters of bench/naive.py
  are the reference (they store no denials). A fitting call (a key with room) is timed
  once per rate set.
* :func:`run_fit_peers`: the fitting call (a limit never reached) of ours against
  ``limits``, and a floor script (TIME + HMGET + HSET on one hash).
* :func:`run_backlog_tasks`: end to end, tasks of one key at ``1/s`` sent at once to one
  worker (2 prefork processes) whose throttle store is the dedicated server: script time
  per call at the first and the last tenth of the first round of denials.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.bulk import Bulk
from bench.common import OUT_DIR, Results, fmt_bytes, limits_peers, percentile, wait_until
from bench.naive import NaiveLimiter
from celery_throttle.keys import state_key
from celery_throttle.protocol import Code, Reservation, WindowCall, WindowReply
from celery_throttle.rates import Rate, parse_rates
from celery_throttle.store import RedisStore
from celery_throttle.timing import grace_us as _grace_us
from celery_throttle.timing import slack_us as _slack_us

SEC = "9 deep backlog"
RATE_SETS = (("1/s",), ("10/s", "1000/h"))
ALGORITHMS = ("sliding", "fixed")
#: Calls measured per round at one depth (denials, early claims), and rounds (best kept).
BATCH = 100
ROUNDS = 5
#: A call slower than this while a backlog is built is kept in the SLOWLOG.
BUILD_SLOWLOG_US = 100
SLOWEST_TARGET_US = 1000
BYTES_TARGET = 4096
RATIO_TARGET = 1.5
PEER_TARGET = 1.25

#: The least a fitting check can do: read the clock, read a hash's fields, write one.
FLOOR_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('HMGET', KEYS[1], 'e', 'd', 'v', ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], now)
return 1
"""


# -- the dedicated server ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DedicatedRedis:
    """A throwaway ``redis-server`` on a free loopback port: no persistence, ours alone."""

    def __init__(self, name: str, binary: str = "redis-server") -> None:
        self.name = name
        self.binary = binary
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.client: Any = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self) -> None:
        logdir = OUT_DIR / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.TemporaryDirectory(prefix="ct-bench-redis-")
        for _ in range(3):  # the port may be taken between finding and binding it
            self.port = _free_port()
            log = logdir / f"redis-{self.name}-{self.port}.log"
            cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no"]
            with open(log, "wb") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=120)
            if wait_until(self._up, 10, 0.05) and self.proc.poll() is None:
                self.url = f"redis://127.0.0.1:{self.port}/0"
                return
            self._stop()
        raise RuntimeError(f"could not start redis-server: {Path(log).read_text(errors='replace')[-500:]}")

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            return True  # exited: wait_until stops, the ping below says no
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        self._stop()
        if self._dir is not None:
            self._dir.cleanup()

    def _stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextmanager
def dedicated_redis(name: str, binary: str = "redis-server") -> Iterator[DedicatedRedis]:
    """A started :class:`DedicatedRedis`, stopped on the way out (failures included)."""
    server = DedicatedRedis(name, binary)
    try:
        server.start()
        yield server
    finally:
        server.stop()


# -- reading the server's own figures -----------------------------------------------------
def evalsha_stats(client: Any) -> tuple[int, int]:
    """(calls, µs) of EVALSHA since the last CONFIG RESETSTAT."""
    stat = client.info("commandstats").get("cmdstat_evalsha") or {}
    return int(stat.get("calls", 0)), int(stat.get("usec", 0))


def slowlog_evalsha(client: Any) -> list[tuple[int, int, list[bytes]]]:
    """Every EVALSHA in the SLOWLOG, oldest first: (id, µs, arguments)."""
    out = []
    for entry in client.slowlog_get(-1):
        command = entry["command"]
        if command.startswith(b"EVALSHA "):
            out.append((int(entry["id"]), int(entry["duration"]), command.split(b" ")))
    out.sort()
    return out


@dataclass
class Sample:
    """Script time of one batch of calls."""

    calls: int
    usec: int
    slowest: int
    #: Calls of SLOWEST_TARGET_US or more.
    over: int = 0

    @property
    def per_call(self) -> float:
        return self.usec / self.calls if self.calls else float("nan")


def probe(client: Any, fn: Callable[[], Any]) -> Sample:
    """Run ``fn`` between a reset and a read of the server's EVALSHA figures."""
    client.config_resetstat()
    client.slowlog_reset()
    fn()
    return _read(client)


def _read(client: Any) -> Sample:
    calls, usec = evalsha_stats(client)
    durations = [d for _, d, _ in slowlog_evalsha(client)]
    return Sample(calls, usec, max(durations, default=0), sum(1 for d in durations if d >= SLOWEST_TARGET_US))


def best(samples: Sequence[Sample]) -> Sample:
    """The round with the least script time per call; the slowest call of them all."""
    low = min(samples, key=lambda s: s.per_call)
    return Sample(low.calls, low.usec, max(s.slowest for s in samples), sum(s.over for s in samples))


# -- building backlogs --------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One algorithm and rate set, with the timings the limiter gives it."""

    algorithm: str
    rates: tuple[Rate, ...]

    @property
    def name(self) -> str:
        return f"{self.algorithm} {'+'.join(str(r) for r in self.rates)}"

    @property
    def grace(self) -> int:
        return _grace_us(self.rates, None)

    @property
    def slack(self) -> int:
        return _slack_us(self.rates)

    def request(self) -> WindowCall:
        return WindowCall(self.algorithm, tuple(self.rates), 1, grace_us=self.grace, slack_us=self.slack)

    def call(self, store: RedisStore, key: str) -> WindowReply:
        return store.acquire(key, self.request(), reserve=True)

    def claim(self, store: RedisStore, key: str, held: Reservation, task_id: str) -> WindowReply:
        return store.claim(key, self.request(), held, marker=f"{key}:claimed:{task_id}:{held.start_us}",
                           reserve=True)


class _Collect(Bulk):
    """Pipelined store calls (see bench/bulk.py) that keep every reply, with its key."""

    def __init__(self, store: Any, batch: int = 1000) -> None:
        super().__init__(store, batch)
        self.replies: list[tuple[str, WindowReply]] = []
        self._keys: list[str] = []

    def _queue(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> list[int]:
        self._keys.append(keys[0])
        return super()._queue(script, keys, args)

    def flush(self) -> list[Any]:
        raw = super().flush()
        keys, self._keys = self._keys[:len(raw)], self._keys[len(raw):]
        self.replies.extend(zip(keys, (WindowReply(*r) for r in raw)))
        return raw


def build(store: RedisStore, cfg: Config, keys: Sequence[str], depth: int) -> dict[str, list[Reservation]]:
    """Fill each key's window, then give it ``depth`` reservations; returns them in order."""
    held: dict[str, list[Reservation]] = {k: [] for k in keys}
    wanted = {k: min(r.limit for r in cfg.rates) + depth for k in keys}
    for _ in range(5):  # a window that opened meanwhile admits a few more: top up
        todo = {k: n for k, n in wanted.items() if n > 0}
        if not todo:
            break
        with _Collect(store) as bulk:
            for k, n in todo.items():
                for _ in range(n):
                    cfg.call(store, k)
        for k, reply in bulk.replies:
            if reply.code == Code.RESERVED:
                held[k].append(Reservation(reply.start_us, reply.latest_us, 1, reply.grace_us, reply.epoch))
        wanted = {k: depth - len(held[k]) for k in keys}
    short = [k for k in keys if len(held[k]) != depth]
    if short:
        raise RuntimeError(f"{cfg.name}: {short[0]} holds {len(held[short[0]])} reservations, not {depth}")
    return held


def _now_us(client: Any) -> int:
    sec, usec = client.time()
    return int(sec) * 1_000_000 + int(usec)


@dataclass
class Depth:
    """What one depth of one configuration measured."""

    depth: int
    denial: Sample
    due: Sample
    early: Sample
    memory: int
    values: int
    build_s: float
    build_slowest: int
    extra: dict[str, Any] = field(default_factory=dict)


def measure_config(client: Any, store: RedisStore, cfg: Config, prefix: str,
                   depths: Sequence[int]) -> list[Depth]:
    """Build a backlog of each depth, then time denials and claims at every depth.

    Rounds go over every depth in turn (the order reversed each round), so a noisy moment
    of the machine does not land on one depth's calls alone; the best round is kept. Below
    BATCH reservations, one key per measured call (built just before its batch) keeps the
    depth what it says; deeper, one key takes every call, so it grows by the denials.
    """
    tag = f"{cfg.algorithm}-{len(cfg.rates)}r"
    made: list[str] = []

    def backlog(depth: int, n: int, name: str) -> dict[str, list[Reservation]]:
        keys = [state_key(prefix, "backlog", f"{tag}-d{depth}-{name}-{i}") for i in range(n)]
        made.extend(keys)
        return build(store, cfg, keys, depth)

    deep: dict[int, dict[str, list[Reservation]] | None] = {}
    builds: dict[int, tuple[float, int, int]] = {}
    client.config_set("slowlog-log-slower-than", BUILD_SLOWLOG_US)
    for depth in depths:
        print(f"backlog: {cfg.name}, building {depth:,} reservations ...", flush=True)
        client.slowlog_reset()
        t0 = time.perf_counter()
        deep[depth] = None if depth < BATCH else backlog(depth, 1, "deep")
        built = [d for _, d, _ in slowlog_evalsha(client)]
        builds[depth] = (time.perf_counter() - t0, max(built, default=0),
                         sum(1 for d in built if d >= SLOWEST_TARGET_US))
    client.config_set("slowlog-log-slower-than", 0)
    first = {d: next(iter(deep[d])) if deep[d] else None for d in depths}
    samples: dict[str, dict[int, list[Sample]]] = {m: {d: [] for d in depths} for m in ("deny", "early", "due")}
    codes: dict[str, dict[int, Counter[int]]] = {m: {d: Counter() for d in depths} for m in samples}

    def rounds(measure: Callable[[int, int], Sample], name: str) -> None:
        for r in range(ROUNDS):
            for depth in (depths if r % 2 == 0 else depths[::-1]):
                samples[name][depth].append(measure(depth, r))

    def fresh(depth: int, name: str) -> dict[str, list[Reservation]]:
        """BATCH keys of ``depth``, none of whose reservations comes due within 0.3 s (a
        fixed window's comes at the next boundary: past it, a call would fit again)."""
        for attempt in range(3):
            held = backlog(depth, BATCH, f"{name}-{attempt}")
            soonest = min(h[0].start_us for h in held.values())
            wait = soonest - _now_us(client)
            if wait > 300_000:
                break
            time.sleep(max(wait, 0) / 1e6 + 0.01)
        return held

    def denials(depth: int, r: int) -> Sample:
        held = deep[depth]
        if held is None:
            held = fresh(depth, f"deny{r}")
            first[depth] = first[depth] or next(iter(held))
        keys = list(held) if len(held) > 1 else list(held) * BATCH

        def run() -> None:
            for k in keys:
                codes["deny"][depth][cfg.call(store, k).code] += 1
        return probe(client, run)

    def early(depth: int, r: int) -> Sample:
        # Claims of a reservation still ahead (code 2: the task waits, or goes back).
        held = deep[depth]
        far = ([(k, h[0]) for k, h in fresh(depth, f"early{r}").items()] if held is None
               else [(k, h[-1]) for k, h in held.items()] * BATCH)

        def run() -> None:
            for i, (k, h) in enumerate(far):
                codes["early"][depth][cfg.claim(store, k, h, f"early-{r}-{i}").code] += 1
        return probe(client, run)

    # On-time claims of the front reservations, each at its start + 0.5 ms, as a worker
    # claims a task that arrives on time. That time is passed to the script instead of
    # waited for (a rate of 1/s comes due once a second): a store whose clock says so.
    sim = [0]
    at = RedisStore(store.url, store.prefix, clock=lambda: sim[0])
    fronts: dict[int, list[tuple[int, str, Reservation]]] = {}

    def due(depth: int, r: int) -> Sample:
        if deep[depth] is None:
            held = backlog(depth, BATCH, f"due{r}")
            items = sorted((h.start_us, k, h) for k, hs in held.items() for h in hs)
        else:
            items = fronts[depth][r * BATCH:(r + 1) * BATCH]

        def run() -> None:
            for i, (start, k, h) in enumerate(items):
                sim[0] = start + 500
                codes["due"][depth][cfg.claim(at, k, h, f"due-{r}-{i}").code] += 1
        return probe(client, run)

    print(f"backlog: {cfg.name}, measuring at {', '.join(f'{d:,}' for d in depths)} ...", flush=True)
    rounds(denials, "deny")
    rounds(early, "early")
    now = _now_us(client)  # the fronts still ahead
    fronts.update({d: sorted((h.start_us, k, h) for k, hs in held.items() for h in hs if h.start_us > now)
                   for d, held in deep.items() if held is not None})
    rounds(due, "due")
    at.close()
    out = []
    for depth in depths:
        key = first[depth]
        memory = int(client.memory_usage(key, samples=0) or 0)
        values = sum(len(v) for v in client.hgetall(key).values())
        build_s, build_slowest, build_over = builds[depth]
        out.append(Depth(depth, best(samples["deny"][depth]), best(samples["due"][depth]),
                         best(samples["early"][depth]), memory, values, build_s, build_slowest,
                         {"deny codes": dict(codes["deny"][depth]), "early codes": dict(codes["early"][depth]),
                          "due codes": dict(codes["due"][depth]), "build over": build_over}))
    for i in range(0, len(made), 500):
        client.unlink(*made[i:i + 500])
    return out


def measure_fitting(client: Any, store: RedisStore, cfg: Config, prefix: str) -> Sample:
    """A call that fits, on keys that hold a start from one window ago."""
    keys = [state_key(prefix, "fit", f"{cfg.algorithm}-{len(cfg.rates)}r-{i}") for i in range(BATCH * ROUNDS)]
    for k in keys:
        cfg.call(store, k)
    time.sleep(min(r.period for r in cfg.rates) + 2 * cfg.slack / 1e6 + 0.05)
    codes: Counter[int] = Counter()

    def fits(r: int) -> Callable[[], None]:
        def run() -> None:
            for k in keys[r * BATCH:(r + 1) * BATCH]:
                codes[cfg.call(store, k).code] += 1
        return run

    sample = best([probe(client, fits(r)) for r in range(ROUNDS)])
    for k in keys:
        client.unlink(k)
    if codes[Code.RUN] != len(keys):
        raise RuntimeError(f"{cfg.name}: fitting calls answered {dict(codes)}")
    return sample


def measure_naive(client: Any, prefix: str, algorithm: str, limit: int, window_s: float) -> Sample:
    """Denials of a naive limiter whose window is full."""
    naive = NaiveLimiter(client, algorithm)
    key = f"{prefix}:naive-backlog-{algorithm}-{limit}"
    pipe = client.pipeline(transaction=False)
    for i in range(limit):
        naive.queue(pipe, key, limit, window_s, member=f"m{i}")
    pipe.execute()
    if naive.hit(key, limit, window_s, member="x")[0]:
        raise RuntimeError(f"naive {algorithm} {limit}: the window did not fill")

    def denials() -> None:
        for i in range(BATCH):
            naive.hit(key, limit, window_s, member=f"d{i}")

    sample = best([probe(client, denials) for _ in range(ROUNDS)])
    client.delete(key, *client.keys(f"{key}:*"))
    return sample


def _codes(codes: dict[int, int]) -> str:
    names = {Code.RUN: "run", Code.DENIED: "denied", Code.RESERVED: "reserved", Code.EARLY: "early"}
    return "/".join(f"{n} {names.get(c, c)}" for c, n in sorted(codes.items()))


def _all(runs: Sequence[Depth], what: str, code: int) -> bool:
    """Whether every call of that kind answered ``code`` (else it timed something else)."""
    return all(set(d.extra[f"{what} codes"]) == {code} for d in runs)


def _ratio(x: float, base: float) -> float:
    return x / base if base else float("nan")


def _progression(runs: Sequence[Depth], pick: Callable[[Depth], float]) -> tuple[str, float]:
    """"1: 40 · 1,000: 41 (1.03x) · ..." and the worst ratio to depth 1."""
    base = pick(runs[0])
    parts, worst = [], 0.0
    for i, run in enumerate(runs):
        value = pick(run)
        if i == 0:
            parts.append(f"{run.depth:,}: {value:.1f} µs")
        else:
            ratio = _ratio(value, base)
            worst = max(worst, ratio)
            parts.append(f"{run.depth:,}: {value:.1f} ({ratio:.2f}x)")
    return " · ".join(parts), worst


def run_backlog_store(res: Results, prefix: str, depths: Sequence[int]) -> None:
    """The per-call cost, worst call and bytes of one key at each backlog depth."""
    with dedicated_redis("backlog") as red:
        client = red.client
        client.config_set("slowlog-max-len", 20000)
        store = RedisStore(red.url, prefix)
        for rates in RATE_SETS:
            for algorithm in ALGORITHMS:
                cfg = Config(algorithm, parse_rates(list(rates)))
                runs = measure_config(client, store, cfg, prefix, depths)
                fitting = measure_fitting(client, store, cfg, prefix)
                _report_config(res, cfg, runs, fitting)
        for algorithm in ALGORITHMS:
            parts = []
            for rate in ("1/s", "1000/h"):
                r = parse_rates(rate)[0]
                sample = measure_naive(client, prefix, algorithm, r.limit, r.period)
                parts.append(f"{rate}: {sample.per_call:.1f} µs")
            name = "naive fixed (seed)" if algorithm == "fixed" else "naive sliding log"
            res.add(SEC, "µs/denial, window full (reference)", name, " · ".join(parts), "", None,
                    "stores no denials: the same at any backlog; best of "
                    f"{ROUNDS} x {BATCH}")
        store.close()


def _report_config(res: Results, cfg: Config, runs: list[Depth], fitting: Sample) -> None:
    value, worst = _progression(runs, lambda d: d.denial.per_call)
    res.add(SEC, "µs/denial by reservations outstanding", cfg.name, value,
            f"<= {RATIO_TARGET}x depth {runs[0].depth}", worst <= RATIO_TARGET and _all(runs, "deny", 0),
            f"script time (commandstats), best of {ROUNDS} x {BATCH}; each denial reserves one more; answered "
            + ", ".join(_codes(d.extra["deny codes"]) for d in runs))
    value, worst = _progression(runs, lambda d: d.due.per_call)
    res.add(SEC, "µs/claim when due", cfg.name, value, f"<= {RATIO_TARGET}x depth {runs[0].depth}",
            worst <= RATIO_TARGET and _all(runs, "due", Code.RUN),
            f"on-time claims of the front reservations, best of {ROUNDS} x {BATCH}; each passes its start "
            "+0.5 ms as the script's now instead of waiting for it; answered "
            + ", ".join(_codes(d.extra["due codes"]) for d in runs))
    value, worst = _progression(runs, lambda d: d.early.per_call)
    res.add(SEC, "µs/claim, early (code 2)", cfg.name, value, f"<= {RATIO_TARGET}x depth {runs[0].depth}",
            worst <= RATIO_TARGET and _all(runs, "early", Code.EARLY), f"claims of a far-off reservation, best of {ROUNDS} x {BATCH}; answered "
            + ", ".join(_codes(d.extra["early codes"]) for d in runs))
    slowest = max(max(d.denial.slowest, d.due.slowest, d.early.slowest) for d in runs)
    per_depth = " · ".join(f"{d.depth:,}: {max(d.denial.slowest, d.due.slowest, d.early.slowest)}"
                           for d in runs)
    over = " · ".join(f"{d.depth:,}: {d.denial.over + d.due.over + d.early.over}" for d in runs)
    builds = " · ".join(f"{d.depth:,}: {d.build_slowest} µs, {d.extra['build over']} >= 1 ms "
                        f"({d.build_s:.1f}s)" for d in runs[1:])
    res.add(SEC, "slowest call (µs)", cfg.name, per_depth, f"< {SLOWEST_TARGET_US} µs",
            slowest < SLOWEST_TARGET_US,
            f"SLOWLOG of the {3 * ROUNDS * BATCH:,} calls measured at each depth; of them >= 1 ms: "
            f"{over}. Building the backlog (every depth below it, pipelined): {builds}")
    worst_bytes = max(d.memory for d in runs)
    res.add(SEC, "bytes/key: MEMORY USAGE (values)", cfg.name,
            " · ".join(f"{d.depth:,}: {fmt_bytes(d.memory)} ({d.values} B)" for d in runs),
            f"<= {fmt_bytes(BYTES_TARGET)}", worst_bytes <= BYTES_TARGET,
            f"each key after the measured calls (a deep one then holds {ROUNDS * BATCH} more reservations)")
    res.add(SEC, "µs/fitting call (a key with room)", cfg.name, f"{fitting.per_call:.1f} µs", "", None,
            f"best of {ROUNDS} x {BATCH} keys whose last start left the window; "
            "against peers at a limit never reached below")


# -- the fitting call against peers --------------------------------------------------------
def _fit_variants(url: str, client: Any, prefix: str) -> list[tuple[str, str, Callable[[], Any]]]:
    """(name, family, one fitting call) for ours, the peers and the floor."""
    out: list[tuple[str, str, Callable[[], Any]]] = []
    store = RedisStore(url, prefix)
    rates = (Rate(1_000_000, 1.0),)
    grace, slack = _grace_us(rates, None), _slack_us(rates)
    for algorithm in ALGORITHMS:
        key = state_key(prefix, "fit-peers", algorithm)
        out.append((f"ours {algorithm}", algorithm,
                    lambda a=algorithm, k=key: store.acquire(k, WindowCall(a, rates, 1, grace_us=grace,
                                                                           slack_us=slack))))
    out += [(name, "peer " + family, hit) for name, family, hit in limits_peers(url, prefix)]
    sha = client.script_load(FLOOR_LUA)
    floor_key = f"{prefix}:floor"
    out.append(("floor: TIME + HMGET + HSET", "floor", lambda: client.evalsha(sha, 1, floor_key, "f")))
    return out


def run_fit_peers(res: Results, prefix: str, calls: int, rounds: int) -> None:
    """Script time of the fitting call: ours, limits, and the floor, best round of each."""
    with dedicated_redis("fit") as red:
        client = red.client
        client.config_set("slowlog-max-len", 128)
        client.config_set("slowlog-log-slower-than", 10_000)  # only the seriously slow
        variants = _fit_variants(red.url, client, prefix)
        found: dict[str, list[Sample]] = {}
        for r in range(rounds):
            for name, _, fn in (variants if r % 2 == 0 else variants[::-1]):
                for _ in range(50):  # scripts loaded, keys made
                    fn()
                print(f"fitting call: {name}, round {r + 1}/{rounds} ...", flush=True)
                found.setdefault(name, []).append(probe(client, lambda f=fn: [f() for _ in range(calls)]))
        per_call = {name: best(samples).per_call for name, samples in found.items()}
        spread = {name: statistics.median(s.per_call for s in samples) for name, samples in found.items()}
        for name, family, _ in variants:
            res.add(SEC, "fitting call: script µs (limit never reached)", name, f"{per_call[name]:.1f} µs",
                    "", None, f"best of {rounds} x {calls:,} (median round {spread[name]:.1f} µs); "
                    "commandstats EVALSHA usec_per_call, dedicated server")
        floor = per_call.get("floor: TIME + HMGET + HSET", float("nan"))
        for algorithm in ALGORITHMS:
            peers = [(n, per_call[n]) for n, f, _ in variants if f == f"peer {algorithm}"]
            if not peers:
                continue
            peer, peer_us = min(peers, key=lambda p: p[1])
            ours = per_call[f"ours {algorithm}"]
            ratio = ours / peer_us
            res.add(SEC, "fitting call: ours / best peer, script time", f"ours {algorithm}",
                    f"{ratio:.2f}x", f"<= {PEER_TARGET}x", ratio <= PEER_TARGET,
                    f"{ours:.1f} µs vs {peer} {peer_us:.1f} µs; floor {floor:.1f} µs")


# -- end to end -----------------------------------------------------------------------------
def _segment(samples: Sequence[tuple[float, int, int, int]], lo: float, hi: float) -> tuple[float, float]:
    """(µs per script call, µs per denial) between the samples where denials passed lo and hi."""
    start = max((s for s in samples if s[1] <= lo), key=lambda s: s[1], default=samples[0])
    end = min((s for s in samples if s[1] >= hi), key=lambda s: s[1], default=samples[-1])
    calls, usec, denied = end[2] - start[2], end[3] - start[3], end[1] - start[1]
    return (usec / calls if calls else float("nan"), usec / denied if denied else float("nan"))


def run_backlog_tasks(res: Results, prefix: str, tasks: int, rate: str = "1/s") -> None:
    """``tasks`` tasks of one key sent at once to 1 worker x 2 processes; the first round of
    denials (each task turned away once, with a reserved start) timed on the server."""
    from bench.workers import WorkerGroup

    limit = parse_rates(rate)[0].limit
    target = tasks - limit  # the first window's worth runs at once
    label = "backlog-e2e"
    with dedicated_redis("backlog-e2e") as red:
        client = red.client
        # (scripts' own commands are logged too: a few dozen entries per task)
        client.config_set("slowlog-max-len", 50 * tasks + 10_000)
        client.config_set("slowlog-log-slower-than", 0)
        group = WorkerGroup(prefix, "backlog", count=1, concurrency=2,
                            env={"CB_STORE": red.url, "CB_BACKLOG_RATE": rate})
        try:
            print(f"backlog end to end: {tasks} tasks at {rate}, 1 worker x 2 processes ...", flush=True)
            group.start()
            client.config_resetstat()
            client.slowlog_reset()
            denied_key = f"{prefix}:denied:{label}"
            samples = [(time.time(), 0, *evalsha_stats(client))]
            sent: list[float] = []
            sender = threading.Thread(target=lambda: (group.send("backlog", label, group.queue, tasks),
                                                      sent.append(time.time())), daemon=True)
            t0 = time.time()
            sender.start()
            deadline = time.monotonic() + 60 + tasks / 50
            while time.monotonic() < deadline:
                denied = int(client.get(denied_key) or 0)
                samples.append((time.time(), denied, *evalsha_stats(client)))
                if denied >= target:
                    break
                time.sleep(0.01)
            sender.join(60)
            slow = slowlog_evalsha(client)
            store = RedisStore(red.url, prefix)
            _ = store.client
            shas = {s.sha.encode(): name for name, s in store._scripts.items()}
            store.close()
            errors = group.errors()
        finally:
            group.stop()
    done = samples[-1]
    first = _segment(samples, 0, 0.1 * target)
    last = _segment(samples, 0.9 * target, target)
    tag = f"{tasks:,} tasks at {rate}, one key, 1 worker x 2 procs"
    if done[1] < target:
        res.add(SEC, "end to end: first round of denials", "sliding", f"{done[1]}/{target} in "
                f"{done[0] - t0:.0f}s", "", False, tag)
        return
    res.add(SEC, "end to end: script µs/call, first -> last 10% of denials", "sliding",
            f"{first[0]:.1f} -> {last[0]:.1f} µs ({_ratio(last[0], first[0]):.2f}x)",
            f"<= {RATIO_TARGET}x", _ratio(last[0], first[0]) <= RATIO_TARGET,
            f"every EVALSHA (checks, parks, claims, releases); per denial {first[1]:.1f} -> {last[1]:.1f} µs")
    fresh = [d for _, d, parts in slow if shas.get(parts[1]) in ALGORITHMS and _op(parts) in ("screen", "acquire")]
    tenth = max(len(fresh) // 10, 1)
    by_script = Counter(shas.get(parts[1], "?") for _, _, parts in slow)
    slowest = max(slow, key=lambda s: s[1], default=(0, 0, [b"", b""]))
    durations = sorted(d for _, d, _ in slow)
    over = sum(1 for d in durations if d >= SLOWEST_TARGET_US)
    res.add(SEC, "end to end: slowest script call", "sliding", f"{slowest[1]} µs", f"< {SLOWEST_TARGET_US} µs",
            slowest[1] < SLOWEST_TARGET_US,
            f"a {shas.get(slowest[2][1], '?')} script call; {over} of {len(durations)} calls >= "
            f"{SLOWEST_TARGET_US} µs, p99 {percentile(durations, 0.99):.0f} µs. Window checks of fresh "
            f"messages (SLOWLOG): first tenth {_mean(fresh[:tenth]):.1f} µs, last tenth "
            f"{_mean(fresh[-tenth:]):.1f} µs; calls: " + ", ".join(f"{n} {k}" for k, n in by_script.most_common()))
    send_s = (sent[0] - t0) if sent else float("nan")
    res.add(SEC, "end to end: first round of denials took", "sliding", f"{done[0] - t0:.2f}s", "", None,
            f"{target:,} denials ({tag}); sending took {send_s:.2f}s")
    if errors:
        res.notes.append(f"backlog end to end: worker log errors ({len(errors)}): " + " | ".join(errors[:3]))


def _mean(xs: Sequence[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def _op(parts: Sequence[bytes]) -> str:
    """The op (ARGV[2]) of a window script call in the SLOWLOG: EVALSHA sha numkeys keys... argv..."""
    try:
        keys = int(parts[2])
        return parts[3 + keys + 1].decode()
    except (IndexError, ValueError, UnicodeDecodeError):
        return "?"
