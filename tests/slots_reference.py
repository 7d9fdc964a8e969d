"""A pure-Python reference model of ``celery_throttle/lua/slots.lua``: the concurrency
slots of one key, operation by operation (take, enqueue, release, renew, sweep, peek), with the
same state (holders by lease end, the FIFO queue by first wait, the waiting messages)
and the same reply (a ``protocol.SlotReply``). ``tests/test_slots_model.py`` runs the real script against it.

Redis orders a sorted set by score, then by member (bytes); ``_ranked`` does the same.
Times are integer microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from celery_throttle.protocol import SlotCode, SlotReply

__all__ = ["SlotsModel"]


def _ranked(zset: dict[str, int]) -> list[str]:
    return sorted(zset, key=lambda m: (zset[m], m.encode()))


@dataclass
class SlotsModel:
    """One key's slots: ``holders`` (id -> lease end), ``queue`` (id -> first wait) and
    ``messages`` (id -> message)."""

    holders: dict[str, int] = field(default_factory=dict)
    queue: dict[str, int] = field(default_factory=dict)
    messages: dict[str, bytes] = field(default_factory=dict)

    # -- what every operation shares ------------------------------------------------------
    def _reclaim(self, now: int) -> None:
        for holder in [h for h, end in self.holders.items() if end <= now]:
            del self.holders[holder]
            if holder in self.messages:
                self.queue[holder] = 0  # handed over, never came: back to the head

    def _hand_over(self, now: int, limit: int, lease: int, woken: list[tuple[str, bytes | None]],
                   except_: str | None) -> bool:
        free = limit - len(self.holders)
        while free > 0:
            ranked = _ranked(self.queue)
            if not ranked:
                return False
            head = ranked[0]
            if head == except_:
                return True
            del self.queue[head]
            message = self.messages.get(head)
            woken.append((head, message))
            if message is not None:
                self.holders[head] = now + lease
                free -= 1
        return False

    def _reply(self, code: SlotCode, now: int, woken: list[tuple[str, bytes | None]] = (),  # type: ignore[assignment]
               lost: tuple[str, ...] = ()) -> SlotReply:
        return SlotReply(code, len(self.holders), len(self.queue), now, tuple(woken), lost)

    def _own(self, holder: str, now: int, lease: int) -> None:
        self.holders[holder] = now + lease
        self.queue.pop(holder, None)
        self.messages.pop(holder, None)

    # -- the operations ----------------------------------------------------------------------
    def take(self, now: int, limit: int, lease: int, holder: str, message: bytes = b"",
             first_wait: int = 0) -> SlotReply:
        self._reclaim(now)
        woken: list[tuple[str, bytes | None]] = []
        if holder in self.holders:
            self._own(holder, now, lease)
            return self._reply(SlotCode.TAKEN, now)
        at_head = self._hand_over(now, limit, lease, woken, holder)
        if at_head or (len(self.holders) < limit and not self.queue):
            self._own(holder, now, lease)
            return self._reply(SlotCode.TAKEN, now, woken)
        if not message:
            return self._reply(SlotCode.FULL, now, woken)
        self.queue.setdefault(holder, first_wait if first_wait > 0 else now)
        self.messages[holder] = message
        return self._reply(SlotCode.QUEUED, now, woken)

    def enqueue(self, now: int, limit: int, lease: int, task: str, message: bytes = b"") -> SlotReply:
        self._reclaim(now)
        woken: list[tuple[str, bytes | None]] = []
        self._hand_over(now, limit, lease, woken, None)
        if len(self.holders) < limit and not self.queue:
            return self._reply(SlotCode.FREE, now, woken)
        if not message:
            return self._reply(SlotCode.FULL, now, woken)
        self.queue.setdefault(task, now)
        self.messages[task] = message
        return self._reply(SlotCode.QUEUED, now, woken)

    def release(self, now: int, limit: int, lease: int, holder: str) -> SlotReply:
        held = self.holders.pop(holder, None) is not None
        self._reclaim(now)
        woken: list[tuple[str, bytes | None]] = []
        self._hand_over(now, limit, lease, woken, None)
        return self._reply(SlotCode.TAKEN if held else SlotCode.LOST, now, woken)

    def renew(self, now: int, lease: int, holders: list[str]) -> SlotReply:
        lost = []
        for holder in holders:
            end = self.holders.get(holder)
            if end is not None and end > now:
                self.holders[holder] = now + lease
            else:
                self.holders.pop(holder, None)
                lost.append(holder)
        return self._reply(SlotCode.LOST if lost else SlotCode.TAKEN, now, lost=tuple(lost))

    def sweep(self, now: int, limit: int, lease: int) -> SlotReply:
        self._reclaim(now)
        woken: list[tuple[str, bytes | None]] = []
        self._hand_over(now, limit, lease, woken, None)
        return self._reply(SlotCode.TAKEN, now, woken)

    def peek(self, now: int) -> SlotReply:
        running = sum(1 for end in self.holders.values() if end > now)
        return SlotReply(SlotCode.TAKEN, running, len(self.queue), now)

    def running(self, now: int) -> int:
        """Leases that still count at ``now``."""
        return sum(1 for end in self.holders.values() if end > now)
