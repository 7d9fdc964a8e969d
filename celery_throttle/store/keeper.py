"""The keeper's notes in the store (what the keeper of the journal keeps beside it): the epoch (an id the store holds while it holds its
lines, ``epoch.lua``), the keeper's last pass and its lock, and the notes of the tasks the
keeper sent on (each once). The journal itself lives in the broker (:mod:`..check.journaling`)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from ..core.keys import journal_keys
from .scripts import ScriptClient, StoreLock

__all__ = ["KeeperOps"]


class KeeperOps(ScriptClient):
    """The keeper's operations of a store."""

    def add_keeper_scripts(self) -> None:
        self.add_lua("epoch")

    def journal_epoch(self) -> tuple[str, int]:
        """(the store's epoch, when it was made: the store's clock, µs; 0 unknown), made now
        if it has none, or if the server was replaced or evicted keys since (``epoch.lua``)."""
        value, since = self.run("epoch", [journal_keys(self.prefix)[0]], [secrets.token_hex(12)])
        return (value.decode() if isinstance(value, bytes) else str(value)), int(since or 0)

    def journal_state(self) -> dict[str, str]:
        """The last pass's state (``left``, ``at``, ``due``, ``adopted``, ``seen``), the
        urges for a pass (``urges``) and the epoch's fields."""
        with self.errors():
            raw = self._redis.hgetall(journal_keys(self.prefix)[0])
        return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}

    def save_journal_state(self, fields: Mapping[str, Any]) -> None:
        with self.errors():
            self._redis.hset(journal_keys(self.prefix)[0], mapping=dict(fields))

    def urge_journal_pass(self) -> None:
        """Ask every worker's keeper for a pass at its next look: tasks were reported lost
        (their messages gone from the store), and only a pass sends them on. A count, not a
        time: the pass reads it as it begins (``urges``, then saved as ``seen``), and any
        urge after that read asks for one more, however the writers' clocks disagree."""
        with self.errors():
            self._redis.hincrby(journal_keys(self.prefix)[0], "urges", 1)

    def journal_lock(self, lease_s: float) -> StoreLock:
        """The lock of the keeper whose pass runs (one at a time)."""
        return self.lock(journal_keys(self.prefix)[1], lease_s)

    def note_sent_on(self, note: str, value: str, keep_s: int, *, only_if_new: bool = False) -> str:
        """Write ``value`` as the sent-on note ``note`` (``only_if_new``: unless one is there),
        kept ``keep_s`` seconds after the last note; returns the note held then."""
        sent_on = journal_keys(self.prefix)[2]
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            if only_if_new:
                pipe.hsetnx(sent_on, note, value)
            else:
                pipe.hset(sent_on, note, value)
            pipe.expire(sent_on, keep_s)
            pipe.hget(sent_on, note)
            held = pipe.execute()[2]
        return held.decode(errors="replace") if isinstance(held, bytes) else str(held or "")
