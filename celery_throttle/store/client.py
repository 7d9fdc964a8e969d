"""The Redis store: owns the connection, the scripts and the window and control operations.

One client per store, created lazily in the process that uses it (redis-py's pool
resets itself after a fork, so a prefork child gets its own connections). Scripts are
registered once (the window scripts with the timing policy and reply codes put before
them: :func:`window_script`); a restarted or flushed Redis answers NOSCRIPT and the
script is loaded again, so it loses nothing but one round trip. One method per operation
of window.lua (:meth:`RedisStore.acquire`, ``screen``, ``admit``, ``claim``, ``release``,
``settle``, ...), each taking what the script is told about the call as a
:class:`.protocol.WindowCall`, and the index of keys with a line (index.lua). Parked
messages of earlier versions are kept by :class:`.parking_store.ParkingStore`, over the
same client.
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

from ..core.errors import StoreError
from ..core.keys import control_key, line_index_keys, window_keys
from ..core.locks import ForkSafeLock
from ..core.protocol import (
    CONTROL_STAMP,
    FOREVER_US,
    NO_ENTRY,
    STATE_FORMAT,
    STATE_LAYOUT,
    Code,
    Cost,
    Counted,
    Entry,
    StateLayout,
    WindowCall,
    WindowReply,
    window_argv,
)
from ..core.timing import SCRIPT_POLICY, STORE_CONNECT_TIMEOUT, STORE_TIMEOUT, ScriptPolicy
from ..core.urls import safe_url
from .connection import connect
from .doctor import StoreReport, examine

__all__ = ["RedisStore", "lua", "true_lines", "window_preamble", "window_script"]


def lua(name: str) -> str:
    """The source of one of the package's scripts (``celery_throttle/store/lua/``)."""
    return resources.files("celery_throttle.store").joinpath("lua", name).read_text("utf-8")


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
        self._lock = ForkSafeLock()
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
        self._sources["index"] = lua("index.lua")
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

    # -- windows and lines -------------------------------------------------------------
    # One method per operation of window.lua (line.lua's header says what each does).
    def window(self, key: str, op: str, call: WindowCall, *args: Any, cost: Cost | None = None) -> WindowReply:
        """Run operation ``op`` of window.lua on state key ``key`` for ``call``, with the
        operation's own ``args``."""
        raw = self.run(call.algorithm, window_keys(key), window_argv(self.now_arg(), op, call, *args, cost=cost))
        return WindowReply.of(raw)

    def acquire(self, key: str, call: WindowCall, *, lease: int = 0, lease_span_us: int = 0, holder: str = "",
                entry: Entry = NO_ENTRY) -> WindowReply:
        """A fresh call: ``RUN`` (recorded; a lease of ``lease`` units for calls to come
        within ``lease_span_us`` if nothing waits and every rate stays at most half full;
        with a concurrency limit, a slot for ``holder``), else ``QUEUED`` in the key's line
        with ``entry``'s message, ``DENIED`` without one, ``TOO_FAR`` past its max wait."""
        return self.window(key, "acquire", call, lease, lease_span_us, holder, *entry.args())

    def screen(self, key: str, call: WindowCall, entry: Entry = NO_ENTRY) -> WindowReply:
        """As :meth:`acquire`, but a call that fits is not recorded (the pool's acquire will)."""
        return self.window(key, "screen", call, 0, 0, "", *entry.args())

    def admit(self, key: str, call: WindowCall, entry: Entry) -> WindowReply:
        """At publish: ``RUN`` (nothing recorded) if nothing waits and every rate stays at
        most half full; else ``RELEASED`` if it fits now (``entry.id`` is its ticket), else
        as :meth:`acquire`."""
        return self.window(key, "admit", call, *entry.args())

    def front(self, key: str, call: WindowCall, entry: Entry) -> WindowReply:
        """``entry`` joins the line before everyone (a task that backs off)."""
        return self.window(key, "front", call, *entry.args())

    def claim(self, key: str, call: WindowCall, ticket: str, *, early_us: int, holder: str, granted_us: int = 0,
              entry: Entry = NO_ENTRY, stale_ok: bool = False) -> WindowReply:
        """A released task arrives with ``ticket``: ``RUN``, ``RUN_AT`` (at most ``early_us``
        before its start), back in line (``QUEUED``; ``DENIED`` if no message is kept nor
        given), ``WAITED``; an unknown ticket is a fresh call (``holder``, ``entry``).
        ``granted_us``: the start granted to this process before, which it woke too late for.
        ``stale_ok``: answer ``STALE`` rather than send it back under other controls than
        it was released under."""
        return self.window(key, "claim", call, ticket, early_us, holder, granted_us, *entry.args(),
                           "1" if stale_ok else "0")

    def release(self, key: str, call: WindowCall, batch: int) -> WindowReply:
        """Release the heads of the key's line that fit (the releasers)."""
        return self.window(key, "release", call, batch)

    def drain(self, key: str, call: WindowCall, batch: int) -> WindowReply:
        """Release the heads of the key's line whatever the room."""
        return self.window(key, "drain", call, batch)

    def ack(self, key: str, call: WindowCall, tickets: Sequence[str]) -> WindowReply:
        """The tasks released with ``tickets`` were sent to the broker."""
        return self.window(key, "ack", call, *tickets)

    def give_back(self, key: str, call: WindowCall, ticket: str, batch: int) -> WindowReply:
        """The task released with ``ticket`` will not start: its room comes back."""
        return self.window(key, "give_back", call, ticket, batch)

    def settle(self, key: str, call: WindowCall, counted: Counted, delta: Cost, batch: int) -> WindowReply:
        """A call that started, counted as ``counted``, reports its real cost: ``delta``
        more units (negative: fewer) in the span it was counted in."""
        return self.window(key, "settle", call, counted.start_us, counted.latest_us, counted.epoch, batch,
                           cost=delta)

    def ended(self, key: str, call: WindowCall, holder: str, batch: int) -> WindowReply:
        """A body ended: ``holder``'s slot goes (``LOST``: its lease had run out)."""
        return self.window(key, "ended", call, holder, batch)

    def renew(self, key: str, call: WindowCall, holders: Sequence[str]) -> WindowReply:
        """Extend the slot leases of ``holders``; those lost come back in ``reported``."""
        return self.window(key, "renew", call, *holders)

    def drop(self, key: str, call: WindowCall, entries: Sequence[str]) -> WindowReply:
        """Delete ``entries`` waiting in the key's line (an operator's purge)."""
        return self.window(key, "drop", call, *entries)

    def peek(self, key: str, call: WindowCall) -> WindowReply:
        """Usage and the line, recording nothing."""
        return self.window(key, "peek", call)

    # -- the index of keys with a line ---------------------------------------------------
    def index_claim(self, lookahead_us: int, most: int, lease_us: int) -> tuple[int, int, list[tuple[str, int]]]:
        """(now, the earliest due left (-1: none), [(state key, token)]) of the keys due
        within ``lookahead_us``, each claimed for ``lease_us``."""
        reply = self.run("index", list(line_index_keys(self.prefix)), [self.now_arg(), "claim", lookahead_us, most,
                                                                       lease_us])
        return int(reply[0]), int(reply[1]), [(_text(reply[i]), int(reply[i + 1])) for i in range(2, len(reply), 2)]

    def index_settle(self, settled: Sequence[tuple[str, int, int, int]]) -> tuple[int, int]:
        """Each (state key, token, due, computed at) claimed: its due time, unless a newer
        one was written since. Returns (now, the earliest due in the index now, -1: none)."""
        reply = self.run("index", list(line_index_keys(self.prefix)),
                         [self.now_arg(), "settle", *(v for quad in settled for v in quad)])
        return int(reply[0]), int(reply[1])

    def index_note(self, key: str, due_us: int, at_us: int) -> bool:
        """Tell the index when ``key`` next needs a look, as computed at ``at_us`` (the
        line script's now): written unless a newer due time was. True if written."""
        return bool(self.run("index", list(line_index_keys(self.prefix)), [self.now_arg(), "note", key, due_us, at_us]))

    def index_wake(self, keys: Sequence[str]) -> int:
        """Each of ``keys`` the index holds is due now. Returns how many."""
        if not keys:
            return 0
        return int(self.run("index", list(line_index_keys(self.prefix)), [self.now_arg(), "wake", *keys]))

    def read(self, key: str) -> dict[str, bytes]:
        """The raw state hash: field name to value (a rate's value is MessagePack)."""
        with self.errors():
            raw = self.client.hgetall(key)
        return {k.decode(): v for k, v in raw.items()}

    # -- controls -----------------------------------------------------------------------
    def pause(self, field: str, seconds: float | None) -> int:
        """Pause what ``field`` names for ``seconds`` (None: until resumed) from the Redis
        clock's now; returns the end (µs). A longer pause already set stays (pause.lua:
        the compare and the write at once)."""
        length = "" if seconds is None else int(seconds * 1_000_000)
        return int(self.run("pause", [control_key(self.prefix)], [self.now_arg(), field, length, FOREVER_US]))

    def prune_pauses(self, fields: Sequence[str]) -> int:
        """Delete the pauses ``fields`` that are over (a reader saw them so; each is
        looked at again in the script, as a pause may have been set since). How many."""
        if not fields:
            return 0
        return int(self.run("pause", [control_key(self.prefix)], [self.now_arg(), "", "", FOREVER_US, *fields]))

    def report(self) -> StoreReport:
        """What this store risks (eviction, persistence) and its run id: see doctor.py."""
        with self.errors():
            return examine(self.client)

    def now_us(self) -> int:
        """The Redis clock (or the test clock)."""
        if self._clock is not None:
            return int(self._clock())
        with self.errors():
            secs, micros = self.client.time()
        return int(secs) * 1_000_000 + int(micros)

    def clear_control(self, field: str) -> bool:
        """Remove a pause or a live limit; True if it was set."""
        return bool(self.set_controls({}, (field,))[-2])  # (the HDEL's reply: before the stamp's)

    def controls(self) -> dict[str, str]:
        """Every control set (pauses, live limits): field to value."""
        return self.stamped_controls()[1]

    def stamped_controls(self) -> tuple[str | None, dict[str, str]]:
        """The controls' stamp (see :meth:`control_stamp`) and every control set."""
        with self.errors():
            raw = {k.decode(): v.decode(errors="replace")
                   for k, v in self.client.hgetall(control_key(self.prefix)).items()}
        return raw.pop(CONTROL_STAMP, None), raw

    def control_stamp(self) -> str | None:
        """The controls' stamp (every write adds one to it: see :meth:`set_controls`),
        or None if no write ever stamped them."""
        with self.errors():
            raw = self.client.hget(control_key(self.prefix), CONTROL_STAMP)
        return None if raw is None else raw.decode(errors="replace")

    def set_control(self, field: str, value: str) -> None:
        self.set_controls({field: value})

    def set_controls(self, values: Mapping[str, str], clear: Sequence[str] = ()) -> list[Any]:
        """Set the controls ``values``, remove those named in ``clear`` and add one to the
        stamp, at once (MULTI, one round trip): a process that reads the same stamp after
        this has read what it wrote. Returns the replies (the stamp's last)."""
        with self.errors():
            pipe = self.client.pipeline(transaction=True)
            if values:
                pipe.hset(control_key(self.prefix), mapping=dict(values))
            if clear:
                pipe.hdel(control_key(self.prefix), *clear)
            pipe.hincrby(control_key(self.prefix), CONTROL_STAMP, 1)
            return list(pipe.execute())

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
                 "STATE_FORMAT": STATE_FORMAT, "FOREVER_US": FOREVER_US}
    return f"local {', '.join(constants)} = {', '.join(map(str, constants.values()))}\n"


def _window_parts(algorithm: str, policy: ScriptPolicy, layout: StateLayout) -> list[tuple[str, str]]:
    preamble = window_preamble(policy, layout)
    return [("(constants)", preamble), (f"{algorithm}.lua", lua(f"{algorithm}.lua")), ("window.lua", lua("window.lua")),
            ("line.lua", lua("line.lua"))]


def _line_map(parts: Sequence[tuple[str, str]]) -> list[tuple[int, str]]:
    """(first line in the script, file) of each part."""
    out, first = [], 1
    for name, text in parts:
        out.append((first, name))
        first += text.count("\n")
    return out


_SCRIPT_LINE = re.compile(r"user_script:(\d+)")


def _text(value: bytes | str) -> str:
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else value


def true_lines(message: str, lines: Sequence[tuple[int, str]]) -> str:
    """``message`` (a script's error) with each ``user_script:N`` told as ``file.lua:M``."""
    def place(match: re.Match[str]) -> str:
        line = int(match.group(1))
        first, name = max(((f, n) for f, n in lines if f <= line), default=(1, "script"))
        return f"{name}:{line - first + 1}"

    return _SCRIPT_LINE.sub(place, message)
