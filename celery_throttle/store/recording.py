"""The record of what the throttle saw (a Redis stream, ``<prefix>:{record}``), kept only
with ``throttle_record``: each task's arrival, start and end, for ``throttle simulate``."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.keys import record_key
from .scripts import ScriptClient

__all__ = ["RECORD_KEPT_MS", "RecordOps"]

#: A record nothing was added to for this long (ms: a week) goes: recording switched off
#: leaves nothing behind for good.
RECORD_KEPT_MS = 7 * 24 * 3600 * 1000


class RecordOps(ScriptClient):
    """The record's operations of a store."""

    def record(self, events: Sequence[str], keep: int) -> None:
        """Add ``events`` (one JSON text each) to the record, which keeps about the last
        ``keep`` (Redis trims it by whole nodes: ``MAXLEN ~``), for RECORD_KEPT_MS after the
        last. One round trip."""
        if not events:
            return
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            for event in events:
                pipe.xadd(record_key(self.prefix), {"e": event}, maxlen=keep, approximate=True)
            pipe.pexpire(record_key(self.prefix), RECORD_KEPT_MS)
            pipe.execute()

    def recorded(self, since_ms: int, until_ms: int, batch: int = 10_000) -> list[str]:
        """The events added from ``since_ms`` to ``until_ms`` (Redis clock, ms), oldest first."""
        out: list[str] = []
        start = str(since_ms)
        with self.errors():
            while True:
                got = self._redis.xrange(record_key(self.prefix), start, str(until_ms), count=batch)
                for ident, fields in got:
                    value = fields.get(b"e", fields.get("e"))
                    if value is not None:
                        out.append(value.decode(errors="replace") if isinstance(value, bytes) else str(value))
                if len(got) < batch:
                    return out
                last = got[-1][0]
                last = last.decode() if isinstance(last, bytes) else str(last)
                ms, _, seq = last.partition("-")
                start = f"{ms}-{int(seq) + 1}"
