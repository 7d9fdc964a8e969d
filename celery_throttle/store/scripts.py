"""The store's client: the connection, and the scripts run on it.

One client per store, created lazily in the process that uses it (redis-py's pool
resets itself after a fork, so a prefork child gets its own connections). Scripts are
registered once by name; a restarted or flushed Redis answers NOSCRIPT and the script is
loaded again, so it loses nothing but one round trip, and a script's error names the file
and its own line. The operations on it are by family: :mod:`.window` (a key's windows,
line and slots, and the index of keys with a line), :mod:`.controls` (pauses and live
limits), :mod:`.sharing`, :mod:`.recording`, :mod:`.dead_letters`; :class:`.client.RedisStore`
is them all over one client.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from redis.exceptions import LockError, NoScriptError, RedisError

from ..core.errors import StoreError
from ..core.locks import ForkSafeLock
from ..core.timing import SCRIPT_POLICY, STORE_CONNECT_TIMEOUT, STORE_TIMEOUT, ScriptPolicy
from ..core.urls import safe_url, scrub, secrets_of
from .compose import composed, script_parts
from .connection import connect
from .doctor import StoreReport, examine

__all__ = ["ScriptClient", "StoreLock", "text", "true_lines"]


def text(name: bytes | str) -> str:
    """A name or value as Redis returned it, as text (bytes no codec reads kept)."""
    return name.decode(errors="surrogateescape") if isinstance(name, bytes) else name


#: The gain of the round-trip estimator, as 1/this (TCP's smoothed round trip, RFC 6298).
RTT_GAIN_PARTS = 8


class ScriptClient:
    """One Redis (or Redis Cluster) and the scripts registered on it, by name."""

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
        self._lock = ForkSafeLock()
        self._client: Any = None
        #: The server's run id as this store's last report saw it (:meth:`report`).
        self.run_id: str | None = None
        #: How many replicas the store had, and when this process read it (monotonic):
        #: a release waits for one to hold it (lines.py, hold_on_replica).
        self._replicas: tuple[int, float] = (0, float("-inf"))
        #: Every script's source by name, registered at connect (and again after a close),
        #: and where each of its lines comes from.
        self._sources: dict[str, str] = {}
        self._lines: dict[str, list[tuple[int, str]]] = {}
        self._scripts: dict[str, Any] = {}
        self._makers: dict[str, Callable[[], tuple[str, list[tuple[int, str]]]]] = {}
        #: The smoothed round trip of a script call (µs; TCP's estimator, gain 1/8), as
        #: this process measures it: a store far away (another region, a slow link)
        #: answers that late, and a claim that waits for its start allows for it.
        self.rtt_us = 0

    # -- connection -------------------------------------------------------------------
    @property
    def _redis(self) -> Any:
        """The redis-py client, made on first use: private to the store (every operation
        is a named method of it)."""
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

    def add_lua(self, *names: str) -> None:
        """Register scripts of ``lua/`` by their names (``adapt`` for ``adapt.lua``), each
        with the includes it names."""
        scripts = {name: composed(script_parts(f"{name}.lua")) for name in names}
        self.add_scripts({name: source for name, (source, _) in scripts.items()},
                         {name: lines for name, (_, lines) in scripts.items()})

    def add_scripts(self, sources: Mapping[str, str], lines: Mapping[str, list[tuple[int, str]]] | None = None) -> None:
        """Register more scripts by name, for :meth:`run` (``lines``: where the lines of a
        script made of several files come from, for its errors)."""
        with self._lock:
            self._sources.update(sources)
            self._lines.update(lines or {})
            if self._client is not None:
                self._scripts.update({name: self._client.register_script(source) for name, source in sources.items()})

    def add_lazy_scripts(self, makers: Mapping[str, Callable[[], tuple[str, list[tuple[int, str]]]]]) -> None:
        """Register scripts made on their first :meth:`run` (a process runs a few of them,
        and making each takes a few ms): each maker returns the source and its line map."""
        with self._lock:
            self._makers.update(makers)

    def make_scripts(self) -> None:
        """Make every script registered to be made on its first run, now (a worker, before
        its pool forks: every child starts with them made)."""
        for name, maker in list(self._makers.items()):
            if name not in self._sources:
                source, lines = maker()
                self.add_scripts({name: source}, {name: lines})

    def _made(self, script: str) -> Any:
        """The registered script ``script``, made now by its maker (KeyError: none)."""
        source, lines = self._makers[script]()
        self.add_scripts({script: source}, {script: lines})
        return self._scripts[script]

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Any Redis error inside becomes a StoreError naming the (masked) URL."""
        try:
            yield
        except RedisError as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: BaseException, lines: Sequence[tuple[int, str]] | None = None) -> StoreError:
        """The StoreError for ``exc``, with no secret of the store in its text, nor in
        ``exc``'s own (the cause a logged traceback shows): scrubbed in place. (redis-py
        6.2 to 7.2 wrote a Sentinel's password into the error that says it found no master.)
        ``lines``: where a script's lines come from, for its errors (:func:`true_lines`)."""
        secrets = secrets_of(self.url, self.options)
        exc.args = tuple(scrub(arg, secrets) if isinstance(arg, str) else arg for arg in exc.args)
        text = scrub(str(exc), secrets)
        return StoreError(f"Redis at {safe_url(self.url)} failed: {true_lines(text, lines) if lines else text}")

    def run(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        client = self._redis
        # EVALSHA straight from the client: redis-py's Script.__call__ costs a few µs
        # more per call. A restarted or flushed Redis answers NOSCRIPT: load, run again.
        try:
            registered = self._scripts[script]
        except KeyError:
            registered = self._made(script)
        sent = time.perf_counter()
        try:  # (inline, not self.errors(): this is every check's path)
            try:
                reply = client.evalsha(registered.sha, len(keys), *keys, *args)
            except NoScriptError:
                client.script_load(registered.script)
                return client.evalsha(registered.sha, len(keys), *keys, *args)
        except RedisError as exc:
            raise self._failure(exc, self._lines.get(script, [(1, f"{script}.lua")])) from exc
        sample = int((time.perf_counter() - sent) * 1e6)
        self.rtt_us += (sample - self.rtt_us) // RTT_GAIN_PARTS
        return reply

    def measure_rtt(self, times: int = 3) -> int:
        """Set the round-trip estimate from the quickest of ``times`` PINGs (after one that
        connects); returns it (µs). At worker start, before the pool forks: every process
        starts with it, and the first claims of a store far away already allow for it."""
        with self.errors():
            self._redis.ping()
            samples = []
            for _ in range(times):
                sent = time.perf_counter()
                self._redis.ping()
                samples.append(int((time.perf_counter() - sent) * 1e6))
        self.rtt_us = min(samples)
        return self.rtt_us

    def warm(self, connections: int) -> None:
        """Open ``connections`` connections to the store side by side, kept in the pool for
        the calls to come (see timing.FAR_WARM_CONNECTIONS): each PING is sent by a thread
        of its own at once, so each needs a connection of its own."""
        client = self._redis
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
            raise self._failure(failed[0]) from failed[0]

    def now_arg(self) -> str:
        """ARGV[1] of a script that reads the clock: '' (Redis TIME) but under a test clock."""
        return "" if self._clock is None else str(int(self._clock()))

    def read(self, key: str) -> dict[str, bytes]:
        """The raw state hash: field name to value (a rate's value is MessagePack)."""
        with self.errors():
            raw = self._redis.hgetall(key)
        return {k.decode(): v for k, v in raw.items()}

    def report(self, journaled: bool = False) -> StoreReport:
        """What this store risks (eviction, persistence) and its run id: see doctor.py
        (``journaled``: the lines have a copy in the broker); whether it restarted since
        the last report (``restarted_from``)."""
        with self.errors():
            report = examine(self._redis, journaled)
        seen, self.run_id = self.run_id, report.run_id or self.run_id
        if seen is not None and report.run_id is not None and report.run_id != seen:
            return replace(report, restarted_from=seen)
        return report

    def now_us(self) -> int:
        """The Redis clock (or the test clock)."""
        if self._clock is not None:
            return int(self._clock())
        with self.errors():
            secs, micros = self._redis.time()
        return int(secs) * 1_000_000 + int(micros)

    def scan(self, pattern: str) -> Iterator[str]:
        """Key names matching ``pattern``, by SCAN (never KEYS: a busy Redis is not blocked)."""
        with self.errors():
            for name in self._redis.scan_iter(match=pattern, count=500):
                yield name.decode(errors="surrogateescape") if isinstance(name, bytes) else name

    def delete(self, key: str) -> int:
        with self.errors():
            return int(self._redis.delete(key))

    def connect(self) -> None:
        """Make the client now (a URL that names no Redis, a Sentinel URL without its group:
        a clear error here). It connects lazily: a Redis that is down is not an error."""
        _ = self._redis

    def lock(self, key: str, lease_s: float) -> StoreLock:
        """A lease on ``key`` that one process holds at a time (not taken yet)."""
        return StoreLock(self, key, lease_s)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None



class StoreLock:
    """A lease on a key that one process holds at a time, for ``lease_s`` seconds after it
    was taken or last renewed (redis-py's lock, which writes a token of its own). Its token
    is the object's, not a thread's: a worker that stops gives up, from its own thread, the
    lease its sharer's thread took (the next worker need not wait the lease out)."""

    def __init__(self, store: ScriptClient, key: str, lease_s: float) -> None:
        self._store, self._lease_s = store, lease_s
        with store.errors():
            self._lock = store._redis.lock(key, timeout=lease_s, blocking=False, thread_local=False)

    def acquire(self) -> bool:
        """Take the lease if no one holds it; whether this process holds it now."""
        with self._store.errors():
            return bool(self._lock.acquire(blocking=False))

    def renew(self) -> bool:
        """The lease again from now; False if this process no longer holds it (it ran out
        and another took it). Raises StoreError if the store cannot be reached."""
        try:
            with self._store.errors():
                self._lock.extend(self._lease_s, replace_ttl=True)
        except StoreError as exc:
            if isinstance(exc.__cause__, LockError):
                return False
            raise
        return True

    def release(self) -> None:
        """Give the lease up (one that ran out meanwhile is not this process's to give)."""
        try:
            with self._store.errors():
                self._lock.release()
        except StoreError as exc:
            if not isinstance(exc.__cause__, LockError):
                raise


_SCRIPT_LINE = re.compile(r"user_script:(\d+)")


def true_lines(message: str, lines: Sequence[tuple[int, str]]) -> str:
    """``message`` (a script's error) with each ``user_script:N`` told as ``file.lua:M``."""
    def place(match: re.Match[str]) -> str:
        line = int(match.group(1))
        first, name = max(((f, n) for f, n in lines if f <= line), default=(1, "script"))
        return f"{name}:{line - first + 1}"

    return _SCRIPT_LINE.sub(place, message)
