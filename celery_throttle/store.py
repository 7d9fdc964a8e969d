"""The Redis store: owns the connection and the Lua scripts.

One client per store, created lazily in the process that uses it (redis-py's pool
resets itself after a fork, so a prefork child gets its own connections). Scripts are
registered once (the window scripts with the timing policy and reply codes put before
them: :func:`window_script`); a restarted or flushed Redis answers NOSCRIPT and the
script is loaded again, so it loses nothing but one round trip. One method per operation
of window.lua (:meth:`RedisStore.acquire`, ``screen``, ``reserve``, ``admit``, ``claim``, ``peek``),
each taking what the script is told about the call as a :class:`WindowCall`.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property, lru_cache
from importlib import resources
from typing import Any, NamedTuple

from redis.exceptions import NoScriptError, RedisError

from .connection import connect, safe_url
from .controls import FOREVER_US
from .doctor import StoreReport, examine
from .errors import StoreError
from .keys import (
    PARKED_TAG_END,
    broker_index_keys,
    control_key,
    dead_letter_keys,
    glob_escape,
    held_count_key,
    parking_keys,
    wake_key,
)
from .rates import Rate
from .timing import SCRIPT_POLICY, STORE_CONNECT_TIMEOUT, STORE_TIMEOUT, ScriptPolicy

__all__ = ["Code", "RedisStore", "Reservation", "WindowCall", "WindowReply", "window_script"]


def _lua(name: str) -> str:
    return resources.files("celery_throttle").joinpath("lua", name).read_text("utf-8")


@dataclass(frozen=True)
class Reservation:
    """A start reserved for a denied call: it may start in ``[start_us, latest_us]``.

    ``epoch`` names the window state it was made in; a reset or lost state voids it.
    ``lead_us``: how long before ``start_us`` the task was due to arrive.
    ``rates_tag``: which rates it was reserved under (:func:`rates_tag`; 0: unknown). A
    claim under other rates (a live limit set since) gives it back and is checked afresh.
    """

    start_us: int
    latest_us: int
    cost: int
    grace_us: int
    epoch: int
    lead_us: int = 0
    rates_tag: int = 0

    def to_header(self) -> list[int]:
        return [self.start_us, self.latest_us, self.cost, self.grace_us, self.epoch, self.lead_us,
                self.rates_tag]

    def script_args(self) -> list[int]:
        """ARGV[7..12] of window.lua for a claim of it."""
        return [self.start_us, self.latest_us, self.cost, self.grace_us, self.epoch, self.lead_us]

    @classmethod
    def from_header(cls, value: Any) -> Reservation | None:
        """The reservation a header holds, or None for anything else (6 fields: written
        before rates were tagged)."""
        if not isinstance(value, (list, tuple)) or len(value) not in (6, 7):
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53 for v in value):
            return None
        return cls(*value) if value[2] > 0 else None


@lru_cache(maxsize=1024)
def rates_tag(rates: tuple[Rate, ...]) -> int:
    """A short name of a set of rates, carried by the reservations made under it."""
    return zlib.crc32(",".join(map(str, rates)).encode()) or 1


class Code(IntEnum):
    """What window.lua decided (its reply's first field; the script knows each by name)."""

    #: The call's cost is above the limit of one of its rates (nothing else is set).
    TOO_COSTLY = -1
    #: Not now: ``start`` > 0 if a start was reserved, ``wait`` until it.
    DENIED = 0
    #: Start now.
    RUN = 1
    #: A claim that came before its reserved start (``wait`` until it).
    EARLY = 2
    #: The earliest start is further than the caller's max wait: nothing reserved.
    TOO_FAR = 3


@dataclass(frozen=True)
class WindowCall:
    """What window.lua is told about one call, whatever the operation (times in µs)."""

    algorithm: str
    rates: tuple[Rate, ...]
    cost: int = 1
    #: The state's field per rate, when not the rate's own name (a live limit).
    fields: tuple[str, ...] | None = None
    #: How long after its reserved start a call may still use it.
    grace_us: int = 0
    #: How long after the check the body may start and still count as starting then.
    slack_us: int = 0
    #: A start further away than this is not reserved (``Code.TOO_FAR``; 0: no cap).
    max_wait_us: int = 0
    #: Paused until then (Redis clock; 0: not paused): nothing starts before it.
    not_before_us: int = 0
    #: A pause ending further away than this reserves nothing: the reply is a denial
    #: without a start whose wait is this horizon (0: no pause is that long).
    pause_horizon_us: int = 0

    @cached_property
    def argv_tails(self) -> dict[tuple[Any, ...], tuple[int | str, ...]]:
        """ARGV[2..] of window.lua for a call without a claim, by (op, reserve, learn,
        lease, lease span): :func:`window_argv` builds each once per WindowCall, which
        ``Throttle`` keeps per call shape. (Not a field: no part of equality or hash.)"""
        return {}


class WindowReply(NamedTuple):
    """What window.lua answered (times in microseconds of the Redis clock).

    A named tuple: one is built per check, and a frozen dataclass took several times as
    long to build.
    """

    code: int
    wait_us: int
    remaining: int
    clear_at_us: int
    start_us: int
    latest_us: int
    now_us: int
    epoch: int
    #: The learnt dispatch delay of this key (-1: nothing learnt yet).
    lead_us: int
    #: The grace given to the start reserved by this call (0 if none).
    grace_us: int
    #: Units granted as a lease, this call's own included (0 if none).
    leased: int = 0

    @property
    def allowed(self) -> bool:
        return self.code == Code.RUN


#: The gain of the round-trip estimator, as 1/this (TCP's smoothed round trip, RFC 6298).
RTT_GAIN_PARTS = 8


class RedisStore:
    """Window state and parked messages in one Redis (or Redis Cluster)."""

    def __init__(self, url: str, prefix: str, clock: Callable[[], int] | None = None,
                 timeout: float = STORE_TIMEOUT, connect_timeout: float = STORE_CONNECT_TIMEOUT,
                 options: Mapping[str, Any] | None = None, policy: ScriptPolicy = SCRIPT_POLICY) -> None:
        self.url = url
        self.prefix = prefix
        #: ``throttle_redis_options``: passed to redis-py (see connection.py).
        self.options = dict(options or {})
        self.timeout, self.connect_timeout = timeout, connect_timeout
        #: The timing policy window.lua is loaded with (tests load it with others).
        self.policy = policy
        # Test-only: a callable returning "now" in microseconds instead of Redis TIME.
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        #: The smoothed round trip of a script call (µs; TCP's estimator, gain 1/8), as
        #: this process measures it: a store far away (another region, a slow link)
        #: answers that late, and a claim that waits for its start allows for it.
        self.rtt_us = 0

    # -- connection -------------------------------------------------------------------
    @property
    def client(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def _connect(self) -> Any:
        defaults = {"socket_timeout": self.timeout, "socket_connect_timeout": self.connect_timeout,
                    "health_check_interval": 30}
        client = connect(self.url, self.options, **defaults)
        self._scripts = {
            "sliding": client.register_script(window_script("sliding", self.policy)),
            "fixed": client.register_script(window_script("fixed", self.policy)),
            "park": client.register_script(_lua("park.lua")),
            "release": client.register_script(_lua("release.lua")),
            "ack": client.register_script(_lua("ack.lua")),
            "requeue": client.register_script(_lua("requeue.lua")),
            "purge": client.register_script(_lua("purge.lua")),
        }
        return client

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Any Redis error inside becomes a StoreError naming the (masked) URL."""
        try:
            yield
        except RedisError as exc:
            raise StoreError(f"Redis at {safe_url(self.url)} failed: {exc}") from exc

    def _run(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        client = self.client
        # EVALSHA straight from the client: redis-py's Script.__call__ costs a few µs
        # more per call. A restarted or flushed Redis answers NOSCRIPT: load, run again.
        registered = self._scripts[script]
        sent = time.perf_counter()
        try:  # (inline, not self._errors(): this is every check's path)
            try:
                reply = client.evalsha(registered.sha, len(keys), *keys, *args)
            except NoScriptError:
                client.script_load(registered.script)
                return client.evalsha(registered.sha, len(keys), *keys, *args)
        except RedisError as exc:
            raise StoreError(f"Redis at {safe_url(self.url)} failed: {exc}") from exc
        sample = int((time.perf_counter() - sent) * 1e6)
        self.rtt_us += (sample - self.rtt_us) // RTT_GAIN_PARTS
        return reply

    def measure_rtt(self, times: int = 3) -> int:
        """Set the round-trip estimate from the quickest of ``times`` PINGs (after one that
        connects); returns it (µs). At worker start, before the pool forks: every process
        starts with it, and the first claims of a store far away already allow for it."""
        with self._errors():
            self.client.ping()
            samples = []
            for _ in range(times):
                sent = time.perf_counter()
                self.client.ping()
                samples.append(int((time.perf_counter() - sent) * 1e6))
        self.rtt_us = min(samples)
        return self.rtt_us

    def _now_arg(self) -> str:
        return "" if self._clock is None else str(int(self._clock()))

    # -- windows ----------------------------------------------------------------------
    # One method per operation of window.lua (its header says what each does).
    def acquire(self, key: str, call: WindowCall, *, reserve: bool = False, lease: int = 0,
                lease_span_us: int = 0) -> WindowReply:
        """Admit the call now if every rate has room (recorded), else deny it, reserving a
        future start if ``reserve``. ``lease``: units it may take at once for calls to
        come within ``lease_span_us``, granted only while every rate stays at most half
        full (see window.lua)."""
        return self._window(key, "acquire", call, reserve=reserve, lease=lease, lease_span_us=lease_span_us)

    def screen(self, key: str, call: WindowCall, *, reserve: bool = False) -> WindowReply:
        """Like :meth:`acquire`, but a call that fits now is not recorded (the worker's
        pool acquires it when it runs)."""
        return self._window(key, "screen", call, reserve=reserve)

    def reserve(self, key: str, call: WindowCall) -> WindowReply:
        """At publish: reserve a start even for a call that fits now, no sooner than the
        key's learnt dispatch delay from now; the worker claims it when the task arrives."""
        return self._window(key, "reserve", call)

    def admit(self, key: str, call: WindowCall) -> WindowReply:
        """At publish: a call that fits now, every rate staying at most half full, is
        not recorded (``Code.RUN``; ``leased`` is the room left before a rate is half
        full); any other is a :meth:`reserve`."""
        return self._window(key, "admit", call)

    def claim(self, key: str, call: WindowCall, reservation: Reservation, *, marker: str | None = None,
              learn: bool = True, reserve: bool = False, resumed: bool = False) -> WindowReply:
        """Use a start reserved earlier: run if on time, wait if early (``Code.EARLY``),
        give it back and check afresh (as :meth:`acquire`) if late. ``marker`` (a key in
        the same hash tag) makes it single-use; ``learn=False`` for a second claim of the
        same arrival (after waiting out an early one), so the delay estimate sees each
        arrival once. ``resumed``: the start was reserved behind a pause that has been
        lifted since: give it back and check afresh, even before it."""
        return self._window(key, "claim", call, reserve=reserve, claim=reservation, marker=marker,
                            learn="2" if resumed else "1" if learn else "0")

    def peek(self, key: str, call: WindowCall) -> WindowReply:
        """Whether the call would fit now, and usage, recording nothing."""
        return self._window(key, "peek", call)

    def _window(self, key: str, op: str, call: WindowCall, *, reserve: bool = False,
                claim: Reservation | None = None, marker: str | None = None, learn: str = "1",
                lease: int = 0, lease_span_us: int = 0) -> WindowReply:
        args = window_argv(self._now_arg(), op, call, reserve=reserve, claim=claim, learn=learn, lease=lease,
                           lease_span_us=lease_span_us)
        if claim is not None:
            keys = [key, marker] if marker else [key]
        else:
            keys = [key, held_count_key(key)] if op in ("admit", "reserve") else [key]
        # Lua numbers come back as Redis integers: the reply is already ints.
        return WindowReply(*self._run(call.algorithm, keys, args))

    def held_count(self, key: str) -> int:
        """How many tasks of the state hash ``key`` were held back at publish (window.lua
        counts them), lately."""
        with self._errors():
            value = self.client.get(held_count_key(key))
        return int(value) if value is not None and value.isdigit() else 0

    def read(self, key: str) -> dict[str, bytes]:
        """The raw state hash: field name to value (a rate's value is MessagePack)."""
        with self._errors():
            raw = self.client.hgetall(key)
        return {k.decode(): v for k, v in raw.items()}

    # -- controls -----------------------------------------------------------------------
    def pause(self, field: str, seconds: float | None) -> int:
        """Pause what ``field`` names for ``seconds`` (None: until resumed) from the Redis
        clock's now; returns the end (µs). A longer pause already set stays."""
        key = control_key(self.prefix)
        now = self.now_us()
        with self._errors():
            until = FOREVER_US if seconds is None else now + int(seconds * 1_000_000)
            current = self.client.hget(key, field)
            if current is not None and int(current) > until:
                return int(current)
            self.client.hset(key, field, until)
            self._prune_pauses(key, now)
            return until

    def report(self, parks_in_broker: bool = False) -> StoreReport:
        """What this store risks (eviction, persistence) and its run id: see doctor.py."""
        with self._errors():
            return examine(self.client, parks_in_broker)

    def now_us(self) -> int:
        """The Redis clock (or the test clock)."""
        if self._clock is not None:
            return int(self._clock())
        with self._errors():
            secs, micros = self.client.time()
        return int(secs) * 1_000_000 + int(micros)

    def clear_control(self, field: str) -> bool:
        """Remove a pause or a live limit; True if it was set."""
        with self._errors():
            return bool(self.client.hdel(control_key(self.prefix), field))

    def controls(self) -> dict[str, str]:
        """Every control set (pauses, live limits): field to value."""
        with self._errors():
            raw = self.client.hgetall(control_key(self.prefix))
        return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}

    def set_control(self, field: str, value: str) -> None:
        with self._errors():
            self.client.hset(control_key(self.prefix), field, value)

    def _prune_pauses(self, key: str, now: int) -> None:
        """Forget pauses that are over, so the hash every worker reads stays small."""
        over = [f for f, until in self.client.hgetall(key).items() if until.isdigit() and int(until) < now]
        if over:
            self.client.hdel(key, *over)

    def scan(self, pattern: str) -> Iterator[str]:
        """Key names matching ``pattern``, by SCAN (never KEYS: a busy Redis is not blocked)."""
        with self._errors():
            for name in self.client.scan_iter(match=pattern, count=500):
                yield name.decode(errors="surrogateescape") if isinstance(name, bytes) else name

    def delete(self, key: str) -> int:
        with self._errors():
            return int(self.client.delete(key))

    # -- parking ----------------------------------------------------------------------
    def park(self, parked_id: str, due_us: int, message: bytes) -> int:
        due, messages, _ = parking_keys(self.prefix)
        return int(self._run("park", [due, messages], [parked_id, due_us, message]))

    def release(self, lookahead_us: int, limit: int, lease_us: int,
                attempts: int) -> tuple[int, list[tuple[str, int, bytes | None]]]:
        """Take up to ``limit`` parked messages due within ``lookahead_us``, under a lease;
        one handed out ``attempts`` times already becomes a dead letter instead."""
        keys = [*parking_keys(self.prefix), *dead_letter_keys(self.prefix)]
        reply = self._run("release", keys, [self._now_arg(), lookahead_us, limit, lease_us, attempts])
        now = int(reply[0])
        items = [
            (reply[i].decode(), int(float(reply[i + 1])), reply[i + 2])
            for i in range(1, len(reply), 3)
        ]
        return now, items

    def hasten(self, patterns: Sequence[str], due_us: int) -> int:
        """Make every parked message whose id matches one of ``patterns`` (ZSCAN MATCH)
        and is due later than ``due_us`` due then instead; returns how many. (ZSCAN: a
        long list of parked tasks does not block Redis; ZADD XX: one released meanwhile
        is not put back.)"""
        due, _, _ = parking_keys(self.prefix)
        moved = 0
        with self._errors():
            for pattern in patterns:
                batch: dict[Any, int] = {}
                for member, score in self.client.zscan_iter(due, match=pattern, count=1000):
                    if score > due_us:
                        batch[member] = due_us
                    if len(batch) >= 500:
                        moved += len(batch)
                        self.client.zadd(due, batch, xx=True)
                        batch = {}
                if batch:
                    moved += len(batch)
                    self.client.zadd(due, batch, xx=True)
        return moved

    def wake_releasers(self) -> None:
        """Wake one waiting releaser now (it releases everything due)."""
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.lpush(wake_key(self.prefix), 1)
            pipe.pexpire(wake_key(self.prefix), WAKE_TTL_MS)
            pipe.execute()

    def wait_for_wake(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for :meth:`wake_releasers`; True if woken."""
        with self._errors():
            return self.client.blpop([wake_key(self.prefix)], timeout=seconds) is not None

    def ack(self, parked_ids: Sequence[str]) -> int:
        if not parked_ids:
            return 0
        _, messages, inflight = parking_keys(self.prefix)
        attempts, _ = dead_letter_keys(self.prefix)
        return int(self._run("ack", [inflight, messages, attempts], list(parked_ids)))

    def retry_later(self, parked_ids: Sequence[str], due_us: int) -> int:
        """Put messages taken for release back, due at ``due_us`` (a failed release)."""
        due, _, inflight = parking_keys(self.prefix)
        attempts, _ = dead_letter_keys(self.prefix)
        return int(self._run("requeue", [inflight, due, attempts], [due_us, "0", *parked_ids]))

    def dead_letters(self, limit: int = 1000) -> list[tuple[str, int, int, bytes | None]]:
        """Parked messages given up on: (id, when in µs, attempts, message), oldest first."""
        _, messages, _ = parking_keys(self.prefix)
        attempts_key, dead = dead_letter_keys(self.prefix)
        with self._errors():
            ids = self.client.zrange(dead, 0, limit - 1, withscores=True)
            if not ids:
                return []
            names = [i for i, _ in ids]
            bodies = self.client.hmget(messages, names)
            tries = self.client.hmget(attempts_key, names)
        return [(i.decode(), int(when), int(n or 0), body)
                for (i, when), body, n in zip(ids, bodies, tries)]

    def waiting(self, limit: int = 10_000) -> list[tuple[str, int, bytes | None]]:
        """Parked messages waiting for their time: (id, due in µs, message), soonest first."""
        due, messages, _ = parking_keys(self.prefix)
        with self._errors():
            ids = self.client.zrange(due, 0, limit - 1, withscores=True)
            out: list[tuple[str, int, bytes | None]] = []
            for start in range(0, len(ids), 500):
                chunk = ids[start:start + 500]
                bodies = self.client.hmget(messages, [i for i, _ in chunk])
                out += [(i.decode(), int(when), body) for (i, when), body in zip(chunk, bodies)]
        return out

    def find_parked(self, task_id: str) -> list[tuple[str, str, int, bytes | None]]:
        """Where the store holds task ``task_id``: (``waiting`` | ``releasing`` | ``dead``,
        parked id, due / lease expiry / given up at in µs, message), by ZSCAN (a parked id
        is ``[tag|]task id:suffix``: :func:`.parking.parked_task_id`)."""
        due, messages, inflight = parking_keys(self.prefix)
        _, dead = dead_letter_keys(self.prefix)
        found: list[tuple[str, str, int, bytes | None]] = []
        with self._errors():
            for where, key in (("waiting", due), ("releasing", inflight), ("dead", dead)):
                for member, score in self.client.zscan_iter(key, match=f"*{glob_escape(task_id)}:*", count=1000):
                    parked_id = member.decode()
                    if parked_id.rpartition(PARKED_TAG_END)[2].rpartition(":")[0] == task_id:
                        found.append((where, parked_id, int(score), self.client.hget(messages, member)))
        return found

    # -- the index of tasks parked in the broker (see broker_parking.py) ------------------
    def index_in_broker(self, task_id: str, due_us: int, info: str) -> None:
        """Note a task parked in the broker, due at ``due_us``, and what it is."""
        by_due, infos = broker_index_keys(self.prefix)
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.zadd(by_due, {task_id: due_us})
            pipe.hset(infos, task_id, info)
            pipe.execute()

    def find_in_broker(self, task_id: str) -> tuple[int, str] | None:
        """(due in µs, what it is) of a task parked in the broker, if noted."""
        by_due, infos = broker_index_keys(self.prefix)
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.zscore(by_due, task_id)
            pipe.hget(infos, task_id)
            due, info = pipe.execute()
        return None if due is None or info is None else (int(due), info.decode())

    def forget_in_broker(self, task_ids: Sequence[str] = (), due_before_us: int | None = None) -> int:
        """Drop index entries: these tasks', and (``due_before_us``) those due before then,
        1000 at a time. Returns how many."""
        by_due, infos = broker_index_keys(self.prefix)
        with self._errors():
            ids = list(task_ids)
            if due_before_us is not None:
                ids += [i.decode() for i in self.client.zrangebyscore(by_due, "-inf", due_before_us, 0, 1000)]
            if not ids:
                return 0
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(by_due, *ids)
            pipe.hdel(infos, *ids)
            return int(pipe.execute()[0])

    def purge(self, parked_ids: Sequence[str]) -> int:
        """Delete parked messages still waiting (one a releaser took meanwhile goes on)."""
        due, messages, _ = parking_keys(self.prefix)
        attempts, _ = dead_letter_keys(self.prefix)
        return sum(int(self._run("purge", [due, messages, attempts], list(parked_ids[i:i + 500])))
                   for i in range(0, len(parked_ids), 500))

    def requeue_dead(self, parked_ids: Sequence[str]) -> int:
        """Hand dead letters out again, now, with their attempts forgotten."""
        if not parked_ids:
            return 0
        due, _, _ = parking_keys(self.prefix)
        attempts, dead = dead_letter_keys(self.prefix)
        now = self.client.time()
        return int(self._run("requeue", [dead, due, attempts],
                             [now[0] * 1_000_000 + now[1], "1", *parked_ids]))

    def drop_dead(self, parked_ids: Sequence[str]) -> int:
        """Delete dead letters for good."""
        if not parked_ids:
            return 0
        _, messages, _ = parking_keys(self.prefix)
        attempts, dead = dead_letter_keys(self.prefix)
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(dead, *parked_ids)
            pipe.hdel(messages, *parked_ids)
            pipe.hdel(attempts, *parked_ids)
            return int(pipe.execute()[0])

    def parked_count(self) -> tuple[int, int, int]:
        """(waiting, in flight, dead) parked messages."""
        due, _, inflight = parking_keys(self.prefix)
        _, dead = dead_letter_keys(self.prefix)
        with self._errors():
            return int(self.client.zcard(due)), int(self.client.zcard(inflight)), int(self.client.zcard(dead))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def window_script(algorithm: str, policy: ScriptPolicy = SCRIPT_POLICY) -> str:
    """window.lua with its algorithm and the constants it reads: the timing policy and the
    reply codes (on the first line, so the script's own line numbers shift by one)."""
    constants = {**policy.values(), **{code.name: int(code) for code in Code}}
    preamble = f"local {', '.join(constants)} = {', '.join(map(str, constants.values()))}\n"
    return preamble + _lua(f"{algorithm}.lua") + _lua("window.lua")


def window_argv(now: str, op: str, call: WindowCall, *, reserve: bool = False,
                claim: Reservation | None = None, learn: str = "1", lease: int = 0,
                lease_span_us: int = 0) -> list[int | str]:
    """ARGV of window.lua, in the order its header documents (``tests/test_script_format.py``
    holds the two together)."""
    if claim is None:
        shape = (op, reserve, learn, lease, lease_span_us)
        tail = call.argv_tails.get(shape)
        if tail is None:
            tail = call.argv_tails[shape] = tuple(_window_argv(op, call, reserve, _NO_CLAIM, learn, lease,
                                                               lease_span_us))
        return [now, *tail]
    return [now, *_window_argv(op, call, reserve, claim.script_args(), learn, lease, lease_span_us)]


def _window_argv(op: str, call: WindowCall, reserve: bool, claim_args: Sequence[int | str], learn: str,
                 lease: int, lease_span_us: int) -> list[int | str]:
    """ARGV[2..] of window.lua."""
    args: list[int | str] = [op, "1" if reserve else "0", call.cost, call.grace_us, call.slack_us]
    args += claim_args
    args += [learn, lease, lease_span_us, call.max_wait_us, call.not_before_us,
             call.pause_horizon_us or _FOREVER_HORIZON]
    args += _rate_args(call.algorithm, call.rates, call.fields)
    return args


_NO_CLAIM = (0, 0, 0, 0, "", 0)
#: A wake-up no releaser took (none runs) is forgotten after this (ms).
WAKE_TTL_MS = 10_000
_FOREVER_HORIZON = 2**53

#: The first letter of a rate's field in the state hash: "s25/1000000" holds sliding
#: "25/s". ``Throttle.status`` reads the rates a hash holds back from these names.
ALGORITHM_TAGS = {"sliding": "s", "fixed": "f"}


def rate_field(algorithm: str, rate: Rate) -> str:
    return f"{ALGORITHM_TAGS[algorithm]}{rate.limit}/{rate.period_us}"


@lru_cache(maxsize=1024)
def _rate_args(algorithm: str, rates: tuple[Rate, ...], fields: tuple[str, ...] | None = None,
               ) -> tuple[int | str, ...]:
    args: list[int | str] = [len(rates)]
    for i, rate in enumerate(rates):
        args += [rate.limit, rate.period_us, fields[i] if fields else rate_field(algorithm, rate)]
    return tuple(args)
