"""Concurrency slots in the store: who holds one (a lease, renewed while the body runs),
who waits for one (FIFO, with its message), and the index of keys with waiting tasks
that a worker's sweep visits. One script, slots.lua, does each operation atomically;
slots.py is the worker's side (taking, renewing, releasing, waking).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .keys import slot_index_key, slot_keys
from .protocol import SlotCode, SlotReply
from .store import RedisStore, lua

__all__ = ["SlotStore", "slots_script"]


#: What the holders' set outlives its longest lease by (ms), before it expires: an idle key's
#: set goes by itself, long after any lease in it has stopped counting.
SLOTS_TTL_PAD_MS = 60_000


def slots_script() -> str:
    """slots.lua, with its reply codes and constants put before it (on a line of their own)."""
    codes = {**{code.name: int(code) for code in SlotCode}, "SLOTS_TTL_PAD_MS": SLOTS_TTL_PAD_MS}
    return f"local {', '.join(codes)} = {', '.join(map(str, codes.values()))}\n" + lua("slots.lua")


class SlotStore:
    """The concurrency slots of one store (its client, prefix and clock)."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        store.add_scripts({"slots": slots_script()})

    def _run(self, state_key: str, op: str, limit: int, lease_us: int, *args: str | bytes) -> SlotReply:
        reply = self.store.run("slots", slot_keys(state_key), [self.store.now_arg(), op, limit, lease_us, *args])
        code, running, waiting, now = (int(v) for v in reply[:4])
        rest = reply[4:]
        if op == "renew":
            return SlotReply(SlotCode(code), running, waiting, now, lost=tuple(_text(v) for v in rest))
        woken = tuple((_text(rest[i]), rest[i + 1]) for i in range(0, len(rest), 2))
        return SlotReply(SlotCode(code), running, waiting, now, woken)

    def take(self, state_key: str, holder: str, limit: int, lease_us: int, message: bytes = b"",
             first_wait_us: int = 0) -> SlotReply:
        """Take a slot for ``holder`` (a task id): ``TAKEN``; else ``FULL`` (``message``
        not given: nothing written) or ``QUEUED`` (queued with ``message``, keeping the
        place it took at ``first_wait_us`` if it waited before). Slots that free on the
        way go to the tasks ahead of it (``woken``)."""
        return self._run(state_key, "take", limit, lease_us, holder, message, str(first_wait_us))

    def enqueue(self, state_key: str, task_id: str, limit: int, lease_us: int, message: bytes = b"") -> SlotReply:
        """At publish: ``FREE`` if a slot is free and no task waits (nothing written: send
        it); else ``FULL`` (``message`` not given) or ``QUEUED`` with ``message``."""
        return self._run(state_key, "enqueue", limit, lease_us, task_id, message, "0")

    def release(self, state_key: str, holder: str, limit: int, lease_us: int) -> SlotReply:
        """Give ``holder``'s slot back (``LOST``: its lease had run out) and hand every
        free slot to the head of the queue (``woken``)."""
        return self._run(state_key, "release", limit, lease_us, holder)

    def renew(self, held: Mapping[str, Sequence[str]], lease_us: int) -> list[tuple[str, str]]:
        """Extend the lease of each holder, one call per state key (a process holds few:
        one per pool process it runs); returns the (state key, holder) whose lease had
        run out."""
        lost: list[tuple[str, str]] = []
        for state_key, holders in held.items():
            if holders:
                reply = self._run(state_key, "renew", 0, lease_us, *holders)
                lost.extend((state_key, holder) for holder in reply.lost)
        return lost

    def sweep(self, state_key: str, limit: int, lease_us: int) -> SlotReply:
        """Reclaim the leases that ran out and hand the free slots to waiting tasks."""
        return self._run(state_key, "sweep", limit, lease_us, "")

    def status(self, state_key: str) -> tuple[int, int]:
        """(slots held, tasks waiting) now."""
        reply = self._run(state_key, "peek", 0, 0, "")
        return reply.running, reply.waiting

    def find(self, task_id: str) -> tuple[str, int, bytes | None] | None:
        """(state key, place in its queue from 1, message) of a task waiting for a slot,
        among the indexed keys (those with tasks waiting), or None."""
        keys = list(self.indexed())
        if not keys:
            return None
        with self.store.errors():
            pipe = self.store.client.pipeline(transaction=False)
            for state_key in keys:
                pipe.zrank(slot_keys(state_key)[1], task_id)
            ranks = pipe.execute()
            for state_key, rank in zip(keys, ranks, strict=True):
                if rank is not None:
                    return state_key, int(rank) + 1, self.store.client.hget(slot_keys(state_key)[2], task_id)
        return None

    # -- the index of keys with waiting tasks ---------------------------------------------
    def index(self, state_key: str, declared: int) -> None:
        with self.store.errors():
            self.store.client.hset(slot_index_key(self.store.prefix), state_key, declared)

    def indexed(self) -> dict[str, int]:
        """State key to the K its code declares (0: none), of every key that had tasks
        waiting for a slot."""
        with self.store.errors():
            raw = self.store.client.hgetall(slot_index_key(self.store.prefix))
        return {_text(k): int(v) for k, v in raw.items() if v.isdigit()}

    def lock_sweep(self, ttl_ms: int) -> bool:
        """Take the turn to sweep for ``ttl_ms`` (one worker per round); False: taken."""
        with self.store.errors():
            return bool(self.store.client.set(f"{slot_index_key(self.store.prefix)}:sweep", "1", nx=True, px=ttl_ms))

    def unindex(self, state_key: str) -> None:
        with self.store.errors():
            self.store.client.hdel(slot_index_key(self.store.prefix), state_key)


def _text(value: bytes | str) -> str:
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else value
