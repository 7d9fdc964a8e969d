"""Parked messages in the store: tasks whose wait is long, or that a pause holds, wait here
as their serialized messages (with a Redis broker; with RabbitMQ they wait in the broker,
broker_parking.py), with the index of those parked in the broker that ``throttle why``
reads. parking.py parks and releases them; the CLI lists, purges and requeues them here.

Keys (keys.py): ``{parked}:due`` (id by due time), ``{parked}:messages``, ``{parked}:inflight``
(ids taken by a releaser, by lease expiry), the dead letters and their attempts, and a
list a resume pushes to wake a releaser. Each operation that must be atomic is a script
of its own (park, release, ack, requeue, purge).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.keys import (
    PARKED_TAG_END,
    broker_index_keys,
    dead_letter_keys,
    glob_escape,
    parking_keys,
    wake_key,
)
from .client import RedisStore
from .scripts import lua

__all__ = ["WAKE_TTL_MS", "ParkingStore"]

#: A wake-up no releaser took (none runs) is forgotten after this (ms).
WAKE_TTL_MS = 10_000
_SCRIPTS = ("park", "release", "ack", "requeue", "purge")


class ParkingStore:
    """The parked messages of one store (its client, prefix and clock)."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        store.add_scripts({name: lua(f"{name}.lua") for name in _SCRIPTS})

    def park(self, parked_id: str, due_us: int, message: bytes) -> int:
        due, messages, _ = parking_keys(self.store.prefix)
        return int(self.store.run("park", [due, messages], [parked_id, due_us, message]))

    def release(self, lookahead_us: int, limit: int, lease_us: int,
                attempts: int) -> tuple[int, list[tuple[str, int, bytes | None]]]:
        """Take up to ``limit`` parked messages due within ``lookahead_us``, under a lease;
        one handed out ``attempts`` times already becomes a dead letter instead."""
        keys = [*parking_keys(self.store.prefix), *dead_letter_keys(self.store.prefix)]
        reply = self.store.run("release", keys, [self.store.now_arg(), lookahead_us, limit, lease_us, attempts])
        now = int(reply[0])
        items = [
            (reply[i].decode(), int(float(reply[i + 1])), reply[i + 2])
            for i in range(1, len(reply), 3)
        ]
        return now, items

    def hasten(self, patterns: Sequence[str], due_us: int) -> int:
        """Make every parked message whose id matches one of ``patterns`` (ZSCAN MATCH)
        and is due later than ``due_us`` due then instead; returns how many. (ZSCAN: a
        long list of parked tasks does not block Redis; ZADD XX: one released meanwhile
        is not put back.)"""
        due, _, _ = parking_keys(self.store.prefix)
        moved = 0
        with self.store.errors():
            for pattern in patterns:
                batch: dict[Any, int] = {}
                for member, score in self.store.client.zscan_iter(due, match=pattern, count=1000):
                    if score > due_us:
                        batch[member] = due_us
                    if len(batch) >= 500:
                        moved += len(batch)
                        self.store.client.zadd(due, batch, xx=True)
                        batch = {}
                if batch:
                    moved += len(batch)
                    self.store.client.zadd(due, batch, xx=True)
        return moved

    def wake_releasers(self) -> None:
        """Wake one waiting releaser now (it releases everything due)."""
        with self.store.errors():
            pipe = self.store.client.pipeline(transaction=False)
            pipe.lpush(wake_key(self.store.prefix), 1)
            pipe.pexpire(wake_key(self.store.prefix), WAKE_TTL_MS)
            pipe.execute()

    def wait_for_wake(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for :meth:`wake_releasers`; True if woken."""
        with self.store.errors():
            return self.store.client.blpop([wake_key(self.store.prefix)], timeout=seconds) is not None

    def ack(self, parked_ids: Sequence[str]) -> int:
        if not parked_ids:
            return 0
        _, messages, inflight = parking_keys(self.store.prefix)
        attempts, _ = dead_letter_keys(self.store.prefix)
        return int(self.store.run("ack", [inflight, messages, attempts], list(parked_ids)))

    def retry_later(self, parked_ids: Sequence[str], due_us: int) -> int:
        """Put messages taken for release back, due at ``due_us`` (a failed release)."""
        due, _, inflight = parking_keys(self.store.prefix)
        attempts, _ = dead_letter_keys(self.store.prefix)
        return int(self.store.run("requeue", [inflight, due, attempts], [due_us, "0", *parked_ids]))

    def dead_letters(self, limit: int = 1000) -> list[tuple[str, int, int, bytes | None]]:
        """Parked messages given up on: (id, when in µs, attempts, message), oldest first."""
        _, messages, _ = parking_keys(self.store.prefix)
        attempts_key, dead = dead_letter_keys(self.store.prefix)
        with self.store.errors():
            ids = self.store.client.zrange(dead, 0, limit - 1, withscores=True)
            if not ids:
                return []
            names = [i for i, _ in ids]
            bodies = self.store.client.hmget(messages, names)
            tries = self.store.client.hmget(attempts_key, names)
        return [(i.decode(), int(when), int(n or 0), body)
                for (i, when), body, n in zip(ids, bodies, tries)]

    def waiting(self, limit: int = 10_000) -> list[tuple[str, int, bytes | None]]:
        """Parked messages waiting for their time: (id, due in µs, message), soonest first."""
        due, messages, _ = parking_keys(self.store.prefix)
        with self.store.errors():
            ids = self.store.client.zrange(due, 0, limit - 1, withscores=True)
            out: list[tuple[str, int, bytes | None]] = []
            for start in range(0, len(ids), 500):
                chunk = ids[start:start + 500]
                bodies = self.store.client.hmget(messages, [i for i, _ in chunk])
                out += [(i.decode(), int(when), body) for (i, when), body in zip(chunk, bodies)]
        return out

    def find_parked(self, task_id: str) -> list[tuple[str, str, int, bytes | None]]:
        """Where the store holds task ``task_id``: (``waiting`` | ``releasing`` | ``dead``,
        parked id, due / lease expiry / given up at in µs, message), by ZSCAN (a parked id
        is ``[tag|]task id:suffix``: :func:`.parking.parked_task_id`)."""
        due, messages, inflight = parking_keys(self.store.prefix)
        _, dead = dead_letter_keys(self.store.prefix)
        found: list[tuple[str, str, int, bytes | None]] = []
        with self.store.errors():
            for where, key in (("waiting", due), ("releasing", inflight), ("dead", dead)):
                for member, score in self.store.client.zscan_iter(key, match=f"*{glob_escape(task_id)}:*", count=1000):
                    parked_id = member.decode()
                    if parked_id.rpartition(PARKED_TAG_END)[2].rpartition(":")[0] == task_id:
                        found.append((where, parked_id, int(score), self.store.client.hget(messages, member)))
        return found

    # -- the index of tasks parked in the broker (see broker_parking.py) ------------------
    def index_in_broker(self, task_id: str, due_us: int, info: str) -> None:
        """Note a task parked in the broker, due at ``due_us``, and what it is."""
        by_due, infos = broker_index_keys(self.store.prefix)
        with self.store.errors():
            pipe = self.store.client.pipeline(transaction=False)
            pipe.zadd(by_due, {task_id: due_us})
            pipe.hset(infos, task_id, info)
            pipe.execute()

    def find_in_broker(self, task_id: str) -> tuple[int, str] | None:
        """(due in µs, what it is) of a task parked in the broker, if noted."""
        by_due, infos = broker_index_keys(self.store.prefix)
        with self.store.errors():
            pipe = self.store.client.pipeline(transaction=False)
            pipe.zscore(by_due, task_id)
            pipe.hget(infos, task_id)
            due, info = pipe.execute()
        return None if due is None or info is None else (int(due), info.decode())

    def forget_in_broker(self, task_ids: Sequence[str] = (), due_before_us: int | None = None) -> int:
        """Drop index entries: these tasks', and (``due_before_us``) those due before then,
        1000 at a time. Returns how many."""
        by_due, infos = broker_index_keys(self.store.prefix)
        with self.store.errors():
            ids = list(task_ids)
            if due_before_us is not None:
                ids += [i.decode() for i in self.store.client.zrangebyscore(by_due, "-inf", due_before_us, 0, 1000)]
            if not ids:
                return 0
            pipe = self.store.client.pipeline(transaction=False)
            pipe.zrem(by_due, *ids)
            pipe.hdel(infos, *ids)
            return int(pipe.execute()[0])

    def purge(self, parked_ids: Sequence[str]) -> int:
        """Delete parked messages still waiting (one a releaser took meanwhile goes on)."""
        due, messages, _ = parking_keys(self.store.prefix)
        attempts, _ = dead_letter_keys(self.store.prefix)
        return sum(int(self.store.run("purge", [due, messages, attempts], list(parked_ids[i:i + 500])))
                   for i in range(0, len(parked_ids), 500))

    def requeue_dead(self, parked_ids: Sequence[str]) -> int:
        """Hand dead letters out again, now, with their attempts forgotten."""
        if not parked_ids:
            return 0
        due, _, _ = parking_keys(self.store.prefix)
        attempts, dead = dead_letter_keys(self.store.prefix)
        now = self.store.client.time()
        return int(self.store.run("requeue", [dead, due, attempts],
                             [now[0] * 1_000_000 + now[1], "1", *parked_ids]))

    def bury(self, dead_id: str, message: bytes) -> None:
        """Keep ``message`` as a dead letter (a task released from a line whose message no
        serializer reads): ``throttle parked --dead`` lists it, ``--requeue`` tries it
        again, ``--drop`` deletes it."""
        _, messages, _ = parking_keys(self.store.prefix)
        attempts, dead = dead_letter_keys(self.store.prefix)
        with self.store.errors():
            pipe = self.store.client.pipeline(transaction=False)
            pipe.hset(messages, dead_id, message)
            pipe.hset(attempts, dead_id, 1)
            pipe.zadd(dead, {dead_id: self.store.now_us()})
            pipe.execute()

    def drop_dead(self, parked_ids: Sequence[str]) -> int:
        """Delete dead letters for good."""
        if not parked_ids:
            return 0
        _, messages, _ = parking_keys(self.store.prefix)
        attempts, dead = dead_letter_keys(self.store.prefix)
        with self.store.errors():
            pipe = self.store.client.pipeline(transaction=False)
            pipe.zrem(dead, *parked_ids)
            pipe.hdel(messages, *parked_ids)
            pipe.hdel(attempts, *parked_ids)
            return int(pipe.execute()[0])

    def parked_count(self) -> tuple[int, int, int]:
        """(waiting, in flight, dead) parked messages."""
        due, _, inflight = parking_keys(self.store.prefix)
        _, dead = dead_letter_keys(self.store.prefix)
        with self.store.errors():
            return int(self.store.client.zcard(due)), int(self.store.client.zcard(inflight)), int(self.store.client.zcard(dead))
