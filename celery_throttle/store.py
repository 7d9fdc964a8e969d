"""The Redis store: owns the connection, the scripts and the window and control operations.

One client per store, created lazily in the process that uses it (redis-py's pool
resets itself after a fork, so a prefork child gets its own connections). Scripts are
registered once (the window scripts with the timing policy and reply codes put before
them: :func:`window_script`); a restarted or flushed Redis answers NOSCRIPT and the
script is loaded again, so it loses nothing but one round trip. One method per operation
of window.lua (:meth:`RedisStore.acquire`, ``screen``, ``reserve``, ``admit``, ``claim``, ``peek``),
each taking what the script is told about the call as a :class:`.protocol.WindowCall`.
Parked messages are kept by :class:`.parking_store.ParkingStore`, over the same client.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from .connection import connect, safe_url
from .controls import FOREVER_US
from .doctor import StoreReport, examine
from .errors import StoreError
from .keys import control_key, held_count_key
from .protocol import (
    STATE_FORMAT,
    STATE_LAYOUT,
    Code,
    Cost,
    Counted,
    Reservation,
    StateLayout,
    WindowCall,
    WindowReply,
    window_argv,
    window_argv_settle,
)
from .timing import SCRIPT_POLICY, STORE_CONNECT_TIMEOUT, STORE_TIMEOUT, ScriptPolicy

__all__ = ["RedisStore", "lua", "true_lines", "window_preamble", "window_script"]


def lua(name: str) -> str:
    """The source of one of the package's scripts (``celery_throttle/lua/``)."""
    return resources.files("celery_throttle").joinpath("lua", name).read_text("utf-8")


#: The gain of the round-trip estimator, as 1/this (TCP's smoothed round trip, RFC 6298).
RTT_GAIN_PARTS = 8


class RedisStore:
    """Window state and controls in one Redis (or Redis Cluster), and the client that
    :class:`.parking_store.ParkingStore` shares."""

    def __init__(self, url: str, prefix: str, clock: Callable[[], int] | None = None,
                 timeout: float = STORE_TIMEOUT, connect_timeout: float = STORE_CONNECT_TIMEOUT,
                 options: Mapping[str, Any] | None = None, policy: ScriptPolicy = SCRIPT_POLICY,
                 layout: StateLayout = STATE_LAYOUT) -> None:
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
        #: The state layout the window scripts are loaded with (tests load them with others).
        self.layout = layout
        #: Every script's source by name, registered at connect (and again after a close),
        #: and where each of its lines comes from.
        self._sources: dict[str, str] = {}
        self._lines: dict[str, list[tuple[int, str]]] = {}
        for algorithm in ("sliding", "fixed"):
            parts = _window_parts(algorithm, policy, layout)
            self._sources[algorithm] = "".join(text for _, text in parts)
            self._lines[algorithm] = _line_map(parts)
        self._sources["pause"] = lua("pause.lua")
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
        self._scripts = {name: client.register_script(source) for name, source in self._sources.items()}
        return client

    def add_scripts(self, sources: Mapping[str, str]) -> None:
        """Register more scripts by name (a companion's, e.g. the parking store's), for
        :meth:`run`."""
        with self._lock:
            self._sources.update(sources)
            if self._client is not None:
                self._scripts.update({name: self._client.register_script(source) for name, source in sources.items()})

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Any Redis error inside becomes a StoreError naming the (masked) URL."""
        try:
            yield
        except RedisError as exc:
            raise StoreError(f"Redis at {safe_url(self.url)} failed: {exc}") from exc

    def run(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        client = self.client
        # EVALSHA straight from the client: redis-py's Script.__call__ costs a few µs
        # more per call. A restarted or flushed Redis answers NOSCRIPT: load, run again.
        registered = self._scripts[script]
        sent = time.perf_counter()
        try:  # (inline, not self.errors(): this is every check's path)
            try:
                reply = client.evalsha(registered.sha, len(keys), *keys, *args)
            except NoScriptError:
                client.script_load(registered.script)
                return client.evalsha(registered.sha, len(keys), *keys, *args)
        except RedisError as exc:
            lines = self._lines.get(script, [(1, f"{script}.lua")])
            raise StoreError(f"Redis at {safe_url(self.url)} failed: {true_lines(str(exc), lines)}") from exc
        sample = int((time.perf_counter() - sent) * 1e6)
        self.rtt_us += (sample - self.rtt_us) // RTT_GAIN_PARTS
        return reply

    def measure_rtt(self, times: int = 3) -> int:
        """Set the round-trip estimate from the quickest of ``times`` PINGs (after one that
        connects); returns it (µs). At worker start, before the pool forks: every process
        starts with it, and the first claims of a store far away already allow for it."""
        with self.errors():
            self.client.ping()
            samples = []
            for _ in range(times):
                sent = time.perf_counter()
                self.client.ping()
                samples.append(int((time.perf_counter() - sent) * 1e6))
        self.rtt_us = min(samples)
        return self.rtt_us

    def warm(self, connections: int) -> None:
        """Open ``connections`` connections to the store side by side, kept in the pool for
        the calls to come (see timing.FAR_WARM_CONNECTIONS): each PING is sent by a thread
        of its own at once, so each needs a connection of its own."""
        client = self.client
        start = threading.Barrier(connections)
        failed: list[BaseException] = []

        def ping() -> None:
            try:
                start.wait()
                client.ping()
            except (RedisError, threading.BrokenBarrierError) as exc:
                failed.append(exc)

        threads = [threading.Thread(target=ping, name="celery_throttle warm") for _ in range(connections)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failed:
            raise StoreError(f"Redis at {safe_url(self.url)} failed: {failed[0]}")

    def now_arg(self) -> str:
        """ARGV[1] of a script that reads the clock: '' (Redis TIME) but under a test clock."""
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
              learn: bool = True, reserve: bool = False, resumed: bool = False, early_us: int = 0) -> WindowReply:
        """Use a start reserved earlier: run if on time, run at the start if at most
        ``early_us`` early (``Code.RUN_AT``), wait if earlier (``Code.EARLY``), give it
        back and check afresh (as :meth:`acquire`) if late. ``marker`` (a key in
        the same hash tag) makes it single-use; ``learn=False`` for a second claim of the
        same arrival (after waiting out an early one), so the delay estimate sees each
        arrival once. ``resumed``: the start was reserved behind a pause that has been
        lifted since: give it back and check afresh, even before it."""
        return self._window(key, "claim", call, reserve=reserve, claim=reservation, marker=marker,
                            learn="2" if resumed else "1" if learn else "0", early_us=early_us)

    def settle(self, key: str, call: WindowCall, counted: Counted, delta: Cost) -> WindowReply:
        """A call that started, counted as ``counted``, reports its real cost: ``delta``
        more units (negative: fewer) in the span it was counted in."""
        args = window_argv_settle(self.now_arg(), call, counted, delta)
        return WindowReply(*self.run(call.algorithm, [key], args))

    def peek(self, key: str, call: WindowCall) -> WindowReply:
        """Whether the call would fit now, and usage, recording nothing."""
        return self._window(key, "peek", call)

    def _window(self, key: str, op: str, call: WindowCall, *, reserve: bool = False,
                claim: Reservation | None = None, marker: str | None = None, learn: str = "1",
                lease: int = 0, lease_span_us: int = 0, early_us: int = 0) -> WindowReply:
        args = window_argv(self.now_arg(), op, call, reserve=reserve, claim=claim, learn=learn, lease=lease,
                           lease_span_us=lease_span_us, early_us=early_us)
        if claim is not None:
            keys = [key, marker] if marker else [key]
        else:
            keys = [key, held_count_key(key)] if op in ("admit", "reserve") else [key]
        # Lua numbers come back as Redis integers: the reply is already ints.
        return WindowReply(*self.run(call.algorithm, keys, args))

    def held_count(self, key: str) -> int:
        """How many tasks of the state hash ``key`` were held back at publish (window.lua
        counts them), lately."""
        with self.errors():
            value = self.client.get(held_count_key(key))
        return int(value) if value is not None and value.isdigit() else 0

    def read(self, key: str) -> dict[str, bytes]:
        """The raw state hash: field name to value (a rate's value is MessagePack)."""
        with self.errors():
            raw = self.client.hgetall(key)
        return {k.decode(): v for k, v in raw.items()}

    # -- controls -----------------------------------------------------------------------
    def pause(self, field: str, seconds: float | None) -> int:
        """Pause what ``field`` names for ``seconds`` (None: until resumed) from the Redis
        clock's now; returns the end (µs). A longer pause already set stays (pause.lua:
        the compare, the write and the prune of pauses that are over, at once)."""
        length = "" if seconds is None else int(seconds * 1_000_000)
        return int(self.run("pause", [control_key(self.prefix)], [self.now_arg(), field, length, FOREVER_US]))

    def report(self, parks_in_broker: bool = False) -> StoreReport:
        """What this store risks (eviction, persistence) and its run id: see doctor.py."""
        with self.errors():
            return examine(self.client, parks_in_broker)

    def now_us(self) -> int:
        """The Redis clock (or the test clock)."""
        if self._clock is not None:
            return int(self._clock())
        with self.errors():
            secs, micros = self.client.time()
        return int(secs) * 1_000_000 + int(micros)

    def clear_control(self, field: str) -> bool:
        """Remove a pause or a live limit; True if it was set."""
        with self.errors():
            return bool(self.client.hdel(control_key(self.prefix), field))

    def controls(self) -> dict[str, str]:
        """Every control set (pauses, live limits): field to value."""
        with self.errors():
            raw = self.client.hgetall(control_key(self.prefix))
        return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}

    def set_control(self, field: str, value: str) -> None:
        with self.errors():
            self.client.hset(control_key(self.prefix), field, value)

    def scan(self, pattern: str) -> Iterator[str]:
        """Key names matching ``pattern``, by SCAN (never KEYS: a busy Redis is not blocked)."""
        with self.errors():
            for name in self.client.scan_iter(match=pattern, count=500):
                yield name.decode(errors="surrogateescape") if isinstance(name, bytes) else name

    def delete(self, key: str) -> int:
        with self.errors():
            return int(self.client.delete(key))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def window_script(algorithm: str, policy: ScriptPolicy = SCRIPT_POLICY, layout: StateLayout = STATE_LAYOUT) -> str:
    """window.lua with its algorithm and the constants they read: the timing policy, the
    reply codes, the state format and layout (on a first line of their own: an error's
    line is told as the file's own by :func:`true_lines`)."""
    return "".join(text for _, text in _window_parts(algorithm, policy, layout))


def window_preamble(policy: ScriptPolicy = SCRIPT_POLICY, layout: StateLayout = STATE_LAYOUT) -> str:
    """The line of constants put before the window scripts."""
    constants = {**policy.values(), **layout.values(), **{code.name: int(code) for code in Code},
                 "STATE_FORMAT": STATE_FORMAT}
    return f"local {', '.join(constants)} = {', '.join(map(str, constants.values()))}\n"


def _window_parts(algorithm: str, policy: ScriptPolicy, layout: StateLayout) -> list[tuple[str, str]]:
    preamble = window_preamble(policy, layout)
    return [("(constants)", preamble), (f"{algorithm}.lua", lua(f"{algorithm}.lua")), ("window.lua", lua("window.lua"))]


def _line_map(parts: Sequence[tuple[str, str]]) -> list[tuple[int, str]]:
    """(first line in the script, file) of each part."""
    out, first = [], 1
    for name, text in parts:
        out.append((first, name))
        first += text.count("\n")
    return out


_SCRIPT_LINE = re.compile(r"user_script:(\d+)")


def true_lines(message: str, lines: Sequence[tuple[int, str]]) -> str:
    """``message`` (a script's error) with each ``user_script:N`` told as ``file.lua:M``."""
    def place(match: re.Match[str]) -> str:
        line = int(match.group(1))
        first, name = max(((f, n) for f, n in lines if f <= line), default=(1, "script"))
        return f"{name}:{line - first + 1}"

    return _SCRIPT_LINE.sub(place, message)
