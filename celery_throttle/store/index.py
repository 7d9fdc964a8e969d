"""The index of keys with a line (index.lua): when each next needs a look, claimed by one
releaser at a time, and the list the releasers wait on between looks.

On a Redis Cluster the index is in :data:`CLUSTER_INDEX_PARTS` parts, each a hash tag of its
own, the tags spread evenly over the cluster's slots, and each key in the part its name
hashes to: every call on a line notes its key's next look in the index, and in one part all
that traffic would land on one master whatever the number of masters. A releaser claims
from each part that is due, woken, or not looked at for a release interval. (A shared
scope's registry is in as many parts: :mod:`.sharing`.) A single Redis has one part, under
the name it always had.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from ..core.keys import line_index_keys, wake_key
from ..core.urls import CLUSTER_SCHEMES
from .scripts import ScriptClient, text

__all__ = ["CLUSTER_INDEX_PARTS", "WAKE_TTL_MS", "IndexOps", "index_tags"]

#: The parts of the index on a Redis Cluster: two a master of a cluster of three, one a
#: master of six. More parts cost a releaser a claim each when they are due.
CLUSTER_INDEX_PARTS = 6
#: A wake-up no releaser took (none runs) is forgotten after this (ms).
WAKE_TTL_MS = 10_000
#: The hash tag of the index's first part: the only one on a single Redis.
_FIRST_TAG = "lines"
#: A wake-up of every part (any value not naming one: a process of an earlier version
#: pushed ``1``).
_ALL = b"*"


@functools.cache
def index_tags(parts: int, first: str = _FIRST_TAG) -> tuple[str, ...]:
    """The hash tags of ``parts`` parts: the i-th one whose slot is in the i-th of ``parts``
    equal ranges of the cluster's slots (``first``, else ``<first>.<n>`` for the least n
    that fits), so that the parts spread over the masters as the slots do."""
    if parts == 1:
        return (first,)
    width, tags = REDIS_CLUSTER_HASH_SLOTS / parts, []
    for i in range(parts):
        n = 0
        while True:
            tag = first if n == 0 else f"{first}.{n}"
            if i * width <= key_slot(tag.encode()) < (i + 1) * width and tag not in tags:
                break
            n += 1
        tags.append(tag)
    return tuple(tags)


class IndexOps(ScriptClient):
    """The index's operations: a key's part, claims, settles, notes and wake-ups."""

    #: The parts of the index (:data:`CLUSTER_INDEX_PARTS` on a Redis Cluster, else 1).
    index_parts = 1
    _index_tags: tuple[str, ...] = (_FIRST_TAG,)

    def add_index_scripts(self, parts: int | None = None) -> None:
        """Register index.lua; the index in ``parts`` parts (None: as the URL says)."""
        self.add_lua("index")
        self.index_parts = parts or (CLUSTER_INDEX_PARTS if self.url.startswith(CLUSTER_SCHEMES) else 1)
        self._index_tags = index_tags(self.index_parts)

    def index_part(self, key: str) -> int:
        """The part of the index (and of a shared scope's registry) that holds ``key``."""
        return 0 if self.index_parts == 1 else zlib.crc32(key.encode()) % self.index_parts

    def index_keys(self, part: int) -> list[str]:
        """index.lua's keys for ``part`` of the index: its sorted set (state key -> due) and
        when each due time in it was computed."""
        return list(line_index_keys(self.prefix, self._index_tags[part]))

    def index_claim(self, lookahead_us: int, most: int, lease_us: int, part: int = 0,
                    settled: Sequence[tuple[str, int, int, int, int]] = ()) -> tuple[int, int, list[tuple[str, int]]]:
        """(now, the earliest due left in ``part`` (-1: none), [(state key, token)]) of its
        keys due within ``lookahead_us``, each claimed for ``lease_us``, once ``settled``
        (the claimer's keys of its last round, as :meth:`index_settle`'s) are settled: one
        call a round, not two."""
        reply = self.run("index", self.index_keys(part), [self.now_arg(), "claim", lookahead_us, most, lease_us,
                                                      *(v for five in settled for v in five)])
        return int(reply[0]), int(reply[1]), [(text(reply[i]), int(reply[i + 1])) for i in range(2, len(reply), 2)]

    def index_settle(self, settled: Sequence[tuple[str, int, int, int, int]], part: int = 0) -> tuple[int, int]:
        """Each (state key, token, due, computed at, controls read at) claimed from
        ``part``: its due time, unless a newer one was written since (one computed under
        controls read before the key's last wake-up leaves it due now, if later). Returns
        (now, the earliest due in the part now, -1: none)."""
        reply = self.run("index", self.index_keys(part), [self.now_arg(), "settle", *(v for five in settled for v in five)])
        return int(reply[0]), int(reply[1])

    def index_note(self, key: str, due_us: int, at_us: int, read_us: int = 0) -> bool:
        """Tell the index when ``key`` next needs a look, as computed at ``at_us`` (the
        line script's now) under controls read at ``read_us`` (0: unknown): written unless
        a newer due time was, or (computed before the key's last wake-up) a later one.
        True if written."""
        return bool(self.run("index", self.index_keys(self.index_part(key)),
                             [self.now_arg(), "note", key, due_us, at_us, read_us]))

    def index_wake(self, keys: Sequence[str]) -> int:
        """Each of ``keys`` the index holds is due now. Returns how many."""
        by_part: dict[int, list[str]] = {}
        for key in keys:
            by_part.setdefault(self.index_part(key), []).append(key)
        return sum(int(self.run("index", self.index_keys(part), [self.now_arg(), "wake", *some]))
                   for part, some in by_part.items())

    def wake_releasers(self, part: int | None = None, due_us: int | None = None) -> None:
        """Wake one releaser waiting in :meth:`wait_for_wake` now, for ``part`` of the index
        (None: every part), to look at it now or (``due_us``, the store's clock) to wait
        for a look due then, which it may not know of."""
        value = _ALL if part is None else f"p{part}" if due_us is None else f"p{part}@{due_us}"
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            pipe.lpush(wake_key(self.prefix), value)
            pipe.pexpire(wake_key(self.prefix), WAKE_TTL_MS)
            pipe.execute()

    def wait_for_wake(self, seconds: float) -> tuple[dict[int, int | None], bool] | None:
        """Wait up to ``seconds`` for :meth:`wake_releasers`: each part of the index it woke,
        to the look it said is due (None: look now), and whether it woke every part (a
        resume, a raised limit: the controls may have changed); None if not woken."""
        with self.errors():
            got = self._redis.blpop([wake_key(self.prefix)], timeout=seconds)
        if got is None:
            return None
        part, _, due = bytes(got[1]).partition(b"@")
        if part[:1] == b"p" and part[1:].isdigit() and int(part[1:]) < self.index_parts:
            return {int(part[1:]): int(due) if due.isdigit() else None}, False
        return dict.fromkeys(range(self.index_parts)), True
