"""The lines for people on call: every key with a line, the tasks waiting in them as
``throttle parked`` lists them, an operator's purge and send-now, and the gauge of tasks
waiting. :class:`.lines.Lines` is built on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from ..celery_parts.messages import decode_message
from ..core.keys import state_key, target_of
from ..core.protocol import WindowReply
from ..core.spec import BoundCall
from ..core.timing import RELEASER_BATCH
from .journaling import Journaling

if TYPE_CHECKING:
    from .checker import Checker
    from .setup import Setup

__all__ = ["OnCall", "Waiting"]


@dataclass(frozen=True)
class Waiting:
    """A task in a key's line (``place`` from 1), or released from it and not started yet
    (``place`` 0), as ``throttle parked`` lists it."""

    scope: str
    key: str | None
    entry: str
    task_id: str
    name: str
    place: int
    #: When it joined its line (Unix time).
    since: float


class OnCall:
    """The operators' look at the lines of one app."""

    setup: Setup
    checker: Checker
    journal: Journaling

    def handle(self, call: BoundCall, reply: WindowReply) -> int:
        raise NotImplementedError

    def note(self, key: str, due_us: int, now_us: int) -> None:
        raise NotImplementedError

    def keys(self) -> list[str]:
        """The state keys that have a line: the index's, and (by SCAN, for the operator's
        tools: one missing from the index is still shown) every one with line counts or
        entries (a store evicting may take either)."""
        return self.setup.store.line_keys()

    def count(self) -> int:
        """How many keys have tasks waiting in their line, or released from it (the index)."""
        return self.setup.store.lines_indexed()

    def total_waiting(self) -> int:
        """How many tasks wait in every line (the gauge)."""
        return self.setup.store.total_waiting()

    def waiting(self, limit: int = 10_000) -> list[Waiting]:
        """The tasks in every line (and those released from one, not started), at most
        ``limit``, each line in its order."""
        store, prefix, out = self.setup.store, self.setup.settings.key_prefix, []
        for key in self.keys():
            target = target_of(prefix, key)
            if target is None:
                continue
            for entry, place, meta, body in store.line_entries(key, limit):
                task_id, since = _meta(meta)
                name = "<message gone>" if body is None else _name(self.setup.app, body)
                out.append(Waiting(target[0], target[1], entry.decode(errors="surrogateescape"), task_id, name, place,
                                   since))
                if len(out) >= limit:
                    return out
        return out

    def purge(self, tasks: list[Waiting]) -> int:
        """Delete ``tasks`` from their lines (they never run; one released meanwhile goes
        on). Returns how many were deleted."""
        by_key: dict[tuple[str, str | None], list[str]] = {}
        for task in tasks:
            if task.place:
                by_key.setdefault((task.scope, task.key), []).append(task.entry)
        deleted = 0
        prefix = self.setup.settings.key_prefix
        for (scope, key), entries in by_key.items():
            call = BoundCall(scope, key, (), 1, "sliding", state_key(prefix, scope, key))
            reply = self.checker.drop(call, entries)
            dropped = [r.id for r in reply.reported if r.kind == "d"]
            deleted += len(dropped)
            self.journal.gone(call.state_key, dropped, reply.now_us)
            if reply.tell_index:
                self.note(call.state_key, reply.due_us, reply.now_us)
        return deleted

    def send_now(self, tasks: list[Waiting]) -> tuple[int, int]:
        """Release the whole line of each key of ``tasks`` whatever its room, and send what
        leaves, each with its ticket: before a rollback to a version that does not read the
        lines, whose workers check each one as a new task. A worker of this version that
        takes one claims it, and puts it back in its place if its key has no room. Returns
        (tasks sent, tasks still waiting: a send that failed puts its task back in its place
        after the send lease)."""
        prefix = self.setup.settings.key_prefix
        targets = sorted({(t.scope, t.key) for t in tasks if t.place}, key=lambda k: (k[0], k[1] or ""))
        sent = 0
        for scope, key in targets:
            # (No rates: the drain releases whatever the room, and needs no task to bind.)
            call = BoundCall(scope, key, (), 1, "sliding", state_key(prefix, scope, key))
            while True:
                reply = self.checker.release(call, RELEASER_BATCH, drain=True)
                sent += self.handle(call, reply)
                if not reply.waiting or not any(r.kind == "r" for r in reply.reported):
                    break
        left = sum(self.setup.store.line_counts(state_key(prefix, scope, key))[0] for scope, key in targets)
        return sent, left


def _meta(raw: bytes | None) -> tuple[str, float]:
    """(task id, when it joined its line, Unix time) of an entry's stored fields."""
    try:
        meta: Any = msgpack.unpackb(raw)
        return str(meta[0]), int(meta[2]) / 1e6
    except Exception:  # noqa: BLE001 - a field we did not write (or none)
        return "?", 0.0


def _name(app: Any, message: bytes) -> str:
    try:
        return str(decode_message(app, message)["task"])
    except Exception:  # noqa: BLE001
        return "<cannot be decoded>"
