"""The operations of a scope's share of slots (core/share.py): the keys that take part (a
hash per scope, key to its weight and most; on a Redis Cluster in as many parts as the
index, :mod:`.index`, each key in its part) and each key's cap (a string in the key's own
hash tag, window.lua's KEYS[8]).

A cap is only ever read by window.lua; it is written here by the sharer, one worker at a
time. Each write is followed, in the same pipeline, by a read of what the key holds: a
cap lowered takes effect at once (no slot is taken beyond it after), so what a key can
hold from then on is the larger of its cap and what it held after the write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ..core.keys import share_key, share_lock_key, share_registry_key, share_wake_key, window_keys
from .index import IndexOps, index_tags
from .scripts import StoreLock

__all__ = ["CAP_KEEP_MS", "Member", "ShareOps"]

#: The hash tag of the registry's first part: the only one on a single Redis (the sharers'
#: locks and wake lists are in it too: one BLPOP waits on the wake lists of many scopes).
_REGISTRY_TAG = "#share"

#: A cap lives this long (ms) after its last write. A cap that runs out is 0: the key's
#: tasks wait, and say so (the sharer writes it again at its next pass); what was held
#: under it is still counted, so a lost cap never lets the scope run more than K.
CAP_KEEP_MS = 3_600_000


class Member(NamedTuple):
    """A key that takes part in its scope's share: its weight and most (0: none)."""

    weight: float
    most: int


def _member(raw: bytes | str) -> Member:
    """A registry value, ``weight,most``; one that does not read so counts as weight 1."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        weight, most = text.split(",")
        member = Member(float(weight), int(most))
    except ValueError:
        return Member(1.0, 0)
    if not 0 < member.weight < float("inf") or member.most < 0:
        return Member(1.0, 0)
    return member


def _number(raw: bytes | str | None) -> int:
    try:
        return max(int(raw or 0), 0)
    except ValueError:
        return 0


class ShareOps(IndexOps):
    """The share operations of a store."""

    def _registry(self, scope: str, key: str | None = None) -> list[str]:
        """The parts of ``scope``'s registry (only the one of ``key``, if given)."""
        tags = index_tags(self.index_parts, _REGISTRY_TAG)
        if key is not None:
            tags = (tags[self.index_part(key)],)
        return [share_registry_key(self.prefix, scope, tag) for tag in tags]

    def share_lock(self, scope: str, lease_s: float) -> StoreLock:
        """The lock of the worker that moves ``scope``'s caps (one at a time)."""
        return self.lock(share_lock_key(self.prefix, scope), lease_s)

    def share_join(self, scope: str, state_key: str, weight: float, most: int) -> None:
        """``state_key`` takes part in ``scope``'s share (again: its weight and most as now),
        and the sharer is woken."""
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            pipe.hset(self._registry(scope, state_key)[0], state_key, f"{weight!r},{most}")
            self._poke(pipe, scope)
            pipe.execute()

    def share_poke(self, scope: str) -> None:
        """Wake ``scope``'s sharer (a slot given back beyond its key's cap)."""
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            self._poke(pipe, scope)
            pipe.execute()

    def _poke(self, pipe: Any, scope: str) -> None:
        wake = share_wake_key(self.prefix, scope)
        pipe.lpush(wake, 1)
        pipe.ltrim(wake, 0, 0)  # (one wakes it: the list never grows, sharer or none)

    def share_wait(self, scopes: Sequence[str], timeout: float) -> bool:
        """Wait ``timeout`` seconds at most for a wake-up of one of ``scopes``' sharer."""
        with self.errors():
            return self._redis.blpop([share_wake_key(self.prefix, s) for s in scopes], timeout=timeout) is not None

    def share_members(self, scope: str) -> dict[str, Member]:
        """The keys that take part in ``scope``'s share."""
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            for part in self._registry(scope):
                pipe.hgetall(part)
            found = pipe.execute()
        return {(k.decode(errors="surrogateescape") if isinstance(k, bytes) else k): _member(v)
                for raw in found for k, v in raw.items()}

    def share_read(self, keys: Sequence[str]) -> list[tuple[int, int, int]]:
        """(cap, held, waiting) of each key: its cap, the slots held (bodies running and
        tasks released to start), the tasks in its line."""
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                _, counts, _, _, _, slots, _ = window_keys(key)
                pipe.get(share_key(key))
                pipe.zcard(slots)
                pipe.hget(counts, "q")
            raw = pipe.execute()
        return [(_number(raw[i]), int(raw[i + 1]), _number(raw[i + 2])) for i in range(0, len(raw), 3)]

    def share_write(self, caps: Sequence[tuple[str, int]]) -> list[tuple[int, int]]:
        """Write each key's cap; (held, waiting) of each, read after its write."""
        if not caps:
            return []
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            for key, cap in caps:
                _, counts, _, _, _, slots, _ = window_keys(key)
                pipe.set(share_key(key), cap, px=CAP_KEEP_MS)
                pipe.zcard(slots)
                pipe.hget(counts, "q")
            raw = pipe.execute()
        return [(int(raw[i + 1]), _number(raw[i + 2])) for i in range(0, len(raw), 3)]

    def share_leave(self, scope: str, members: dict[str, Member]) -> list[str]:
        """Idle keys leave ``scope``'s share: their caps go, then their registry entries,
        then each is read again; one that has work by then (a task that came meanwhile
        saw no cap and joined the registry, which the removal may have undone) joins
        again. Returns the keys that left."""
        if not members:
            return []
        keys = list(members)
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:  # (one by one: each cap is on its key's own slot)
                pipe.delete(share_key(key))
            pipe.execute()
            by_part: dict[str, list[str]] = {}
            for key in keys:
                by_part.setdefault(self._registry(scope, key)[0], []).append(key)
            for part, some in by_part.items():
                self._redis.hdel(part, *some)
        back = [k for k, (_, held, waiting) in zip(keys, self.share_read(keys)) if held or waiting]
        for key in back:
            self.share_join(scope, key, members[key].weight, members[key].most)
        return [k for k in keys if k not in back]
