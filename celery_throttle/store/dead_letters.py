"""Dead letters: tasks released from a line, or sent on by the journal, whose message no
serializer of the app reads (or that could not be rebuilt). Kept, never run, until an
operator looks (``throttle parked --dead``), sends them again (``--requeue``) or deletes
them (``--drop``)."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.keys import dead_letter_keys
from .scripts import ScriptClient, text

__all__ = ["DeadLetterOps"]

#: Ids read, or deleted, in one round trip.
_CHUNK = 500


class DeadLetterOps(ScriptClient):
    """The dead letters of a store."""

    def bury(self, letter_id: str, message: bytes) -> None:
        """Keep ``message`` as a dead letter named ``letter_id`` (one round trip)."""
        messages, by_when = dead_letter_keys(self.prefix)
        with self.errors():
            pipe = self._redis.pipeline(transaction=False)
            pipe.hset(messages, letter_id, message)
            pipe.zadd(by_when, {letter_id: self.now_us()})
            pipe.execute()

    def dead_letters(self, limit: int = 1000) -> list[tuple[str, int, bytes | None]]:
        """The dead letters, oldest first: (id, since when in µs, message)."""
        messages, by_when = dead_letter_keys(self.prefix)
        out: list[tuple[str, int, bytes | None]] = []
        with self.errors():
            ids = self._redis.zrange(by_when, 0, limit - 1, withscores=True)
            for start in range(0, len(ids), _CHUNK):
                chunk = ids[start:start + _CHUNK]
                bodies = self._redis.hmget(messages, [i for i, _ in chunk])
                out += [(text(i), int(when), body) for (i, when), body in zip(chunk, bodies)]
        return out

    def drop_dead(self, letter_ids: Sequence[str]) -> int:
        """Delete these dead letters for good; returns how many there were."""
        messages, by_when = dead_letter_keys(self.prefix)
        dropped = 0
        with self.errors():
            for start in range(0, len(letter_ids), _CHUNK):
                chunk = list(letter_ids[start:start + _CHUNK])
                pipe = self._redis.pipeline(transaction=False)
                pipe.zrem(by_when, *chunk)
                pipe.hdel(messages, *chunk)
                dropped += int(pipe.execute()[0])
        return dropped

    def find_dead(self, pattern: str) -> list[tuple[str, int, bytes | None]]:
        """The dead letters whose id matches ``pattern`` (ZSCAN MATCH: a long list does not
        block Redis): (id, since when in µs, message)."""
        messages, by_when = dead_letter_keys(self.prefix)
        with self.errors():
            found = list(self._redis.zscan_iter(by_when, match=pattern, count=1000))
            bodies = self._redis.hmget(messages, [i for i, _ in found]) if found else []
        return [(text(i), int(when), body) for (i, when), body in zip(found, bodies)]

    def dead_count(self) -> int:
        with self.errors():
            return int(self._redis.zcard(dead_letter_keys(self.prefix)[1]))
