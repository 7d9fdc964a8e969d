"""The lines as the operators' tools, the journal and the releasers' sweep read them: the
keys with a line, their tasks and counts, where one task waits, and the lines missing
from the index. (A line's own operations are window.lua's: :mod:`.window`.)"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from redis.exceptions import RedisError

from ..core.keys import line_scan_patterns, sweep_key, window_keys
from ..core.urls import CLUSTER_SCHEMES
from .index import IndexOps
from .scripts import text

__all__ = ["LineEntry", "LineOps"]

#: Keys or entries read in one round trip.
_BATCH = 1000

#: A release waits this long at most (ms) for a replica of the store to hold it before its
#: tasks are sent (WAIT): a failover then finds it, where a replica short of it would hold
#: the tasks in their lines again and send them a second time. A replica that lags or has
#: gone costs a release that long at most; a store of no replica, nothing.
REPLICA_WAIT_MS = 100
#: How often (seconds) a process reads how many replicas the store has.
REPLICAS_READ_EVERY = 10.0

#: An entry of a line: its id, its place (from 1; 0: released, not started), its stored
#: fields (task id, when it joined: ``<id>#``) and its message (None: gone).
LineEntry = tuple[bytes, int, "bytes | None", "bytes | None"]


class LineOps(IndexOps):
    """What is read of the lines beside their operations."""

    def indexed(self, match: str = "*") -> Iterator[str]:
        """The state keys the index holds (whose names match ``match``), by ZSCAN."""
        with self.errors():
            for part in range(self.index_parts):
                for member, _ in self._redis.zscan_iter(self.index_keys(part)[0], match=match, count=_BATCH):
                    yield text(member)

    def line_keys(self) -> list[str]:
        """The state keys that have a line: the index's, and (by SCAN: one missing from the
        index is still found) every one with line counts or entries."""
        found = dict.fromkeys(self.indexed())
        with self.errors():
            for pattern, suffix in line_scan_patterns(self.prefix):
                for name in self._redis.scan_iter(match=pattern, count=_BATCH):
                    found[text(name)[: -len(suffix)]] = None
        return list(found)

    def lines_indexed(self) -> int:
        with self.errors():
            return sum(int(self._redis.zcard(self.index_keys(part)[0])) for part in range(self.index_parts))

    def total_waiting(self) -> int:
        """How many tasks wait in every line of the index: one ZCARD per key, pipelined."""
        keys, total = list(self.indexed()), 0
        with self.errors():
            for start in range(0, len(keys), _BATCH):
                pipe = self._redis.pipeline(transaction=False)
                for key in keys[start:start + _BATCH]:
                    pipe.zcard(window_keys(key)[2])
                total += sum(int(n) for n in pipe.execute())
        return total

    def line_counts(self, key: str) -> tuple[int, int]:
        """(tasks in line, tasks released and not started) of ``key``."""
        _, _, line, _, out, _, _ = window_keys(key)
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            pipe.zcard(line)
            pipe.zcard(out)
            waiting, released = pipe.execute()
        return int(waiting), int(released)

    def line_entries(self, key: str, limit: int) -> list[LineEntry]:
        """The released entries of ``key`` then its line in order, ``limit`` of each at most."""
        _, _, line, msgs, released, _, _ = window_keys(key)
        with self.errors():
            entries = [(e, 0) for e in self._redis.zrange(released, 0, limit - 1)]
            entries += [(e, n) for n, e in enumerate(self._redis.zrange(line, 0, limit - 1), 1)]
            if not entries:
                return []
            metas = self._redis.hmget(msgs, [e + b"#" for e, _ in entries])
            bodies = self._redis.hmget(msgs, [e for e, _ in entries])
        return [(e, place, meta, body) for (e, place), meta, body in zip(entries, metas, bodies)]

    def line_page(self, key: str, after: Any, most: int) -> list[tuple[bytes, float, bytes | None]]:
        """Up to ``most`` entries of ``key``'s line placed after ``after`` (a ZRANGEBYSCORE
        bound), in order: (entry, place, message)."""
        _, _, line, msgs, _, _, _ = window_keys(key)
        with self.errors():
            page = self._redis.zrangebyscore(line, after, "+inf", start=0, num=most, withscores=True)
            bodies = self._redis.hmget(msgs, [entry for entry, _ in page]) if page else []
        return [(entry, place, body) for (entry, place), body in zip(page, bodies)]

    def find_entry(self, match: str) -> tuple[str, str, int, bytes | None] | None:
        """The first entry whose id matches ``match`` in a line of the index: (``line`` |
        ``released``, state key, place from 1 (0: released), its message)."""
        with self.errors():
            for key in self.indexed():
                _, _, line, msgs, out, _, _ = window_keys(key)
                for entry, _ in self._redis.zscan_iter(line, match=match, count=_BATCH):
                    rank = self._redis.zrank(line, entry)
                    return "line", key, int(rank or 0) + 1, self._redis.hget(msgs, entry)
                for entry, _ in self._redis.zscan_iter(out, match=match, count=_BATCH):
                    return "released", key, 0, self._redis.hget(msgs, entry)
        return None

    def known_entries(self, idents: Sequence[tuple[str, str]]) -> list[bool]:
        """For each (state key, entry): whether the store holds it, waiting in its line,
        released and not started, or started lately. One round trip."""
        return [any(score is not None for score in scores) for scores in self._scores(idents, (2, 4, 6))]

    def hold_on_replica(self) -> int:
        """Wait (REPLICA_WAIT_MS at most) until a replica of the store holds what this
        process wrote last: a release, before its tasks are sent. Returns how many replicas
        hold it (0: none in time, or the store has none). Never raises: a store that cannot
        answer costs the send nothing. (WAIT counts the writes of the connection it is sent
        on: the release's own, as a process's next command takes the connection it gave
        back. Not on a Redis Cluster, whose client sends it to any node.)"""
        now = time.monotonic()
        count, read_at = self._replicas
        try:
            if now - read_at >= REPLICAS_READ_EVERY:
                count = 0 if self.url.startswith(CLUSTER_SCHEMES) else \
                    int(self._redis.info("replication").get("connected_slaves") or 0)
                self._replicas = (count, now)
            return int(self._redis.execute_command("WAIT", 1, REPLICA_WAIT_MS)) if count else 0
        except (RedisError, OSError, ValueError):
            return 0

    def in_lines(self, idents: Sequence[tuple[str, str]]) -> list[str]:
        """For each (state key, entry): where the store holds it: ``line`` (waiting),
        ``out`` (released and not started) or ``""``. One round trip."""
        return ["line" if line is not None else "out" if out is not None else ""
                for line, out in self._scores(idents, (2, 4))]

    def _scores(self, idents: Sequence[tuple[str, str]], sets: Sequence[int]) -> list[list[Any]]:
        """For each (state key, entry): its score in each of the key's sorted sets ``sets``
        (their places in :func:`.window_keys`: 2 the line, 4 the released, 6 the started
        lately), None where it is not. One round trip."""
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            for key, entry in idents:
                keys = window_keys(key)
                for i in sets:
                    pipe.zscore(keys[i], entry)
            scores = pipe.execute() if idents else []
        n = len(sets)
        return [scores[n * i:n * i + n] for i in range(len(idents))]

    def unindexed_lines(self, sweep_ms: int) -> Iterable[str] | None:
        """The state keys with a line (counts or entries) the index does not hold, by SCAN;
        None if another process swept within ``sweep_ms`` (one sweep at a time)."""
        with self.errors():
            if not self._redis.set(sweep_key(self.prefix), "1", nx=True, px=sweep_ms):
                return None
            seen: set[str] = set()
            missing = []
            for pattern, suffix in line_scan_patterns(self.prefix):
                for name in self._redis.scan_iter(match=pattern, count=_BATCH):
                    key = text(name)[: -len(suffix)]
                    if key in seen:
                        continue
                    seen.add(key)
                    if self._redis.zscore(self.index_keys(self.index_part(key))[0], key) is None:
                        missing.append(key)
        return missing
