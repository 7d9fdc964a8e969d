"""The operations on the control hash: pauses (pause.lua: the compare and the write at
once) and the live limits, every write stamped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.keys import control_key
from ..core.state import CONTROL_STAMP, FOREVER_US
from .scripts import ScriptClient

__all__ = ["ControlOps"]

#: The controls' stamp and the server's clock, read at once; and a hash no write stamped
#: (none at all, the usual case where no control was ever set) whole, in the same round
#: trip: it is read whole anyway.
_STAMP_AND_TIME = """local stamp, now = redis.call('HGET', KEYS[1], ARGV[1]), redis.call('TIME')
if stamp then return {stamp, now} end
return {false, now, redis.call('HGETALL', KEYS[1])}"""


class ControlOps(ScriptClient):
    """The control operations of a store."""

    def add_control_scripts(self) -> None:
        self.add_lua("pause")

    # -- controls -----------------------------------------------------------------------
    def pause(self, field: str, seconds: float | None) -> int:
        """Pause what ``field`` names for ``seconds`` (None: until resumed) from the Redis
        clock's now; returns the end (µs). A longer pause already set stays (pause.lua:
        the compare and the write at once)."""
        length = "" if seconds is None else int(seconds * 1_000_000)
        return int(self.run("pause", [control_key(self.prefix)], [self.now_arg(), field, length, FOREVER_US]))

    def prune_pauses(self, fields: Sequence[str]) -> int:
        """Delete the pauses ``fields`` that are over (a reader saw them so; each is
        looked at again in the script, as a pause may have been set since). How many."""
        if not fields:
            return 0
        return int(self.run("pause", [control_key(self.prefix)], [self.now_arg(), "", "", FOREVER_US, *fields]))

    def clear_control(self, field: str) -> bool:
        """Remove a pause or a live limit; True if it was set."""
        return bool(self.set_controls({}, (field,))[-2])  # (the HDEL's reply: before the stamp's)

    def controls(self) -> dict[str, str]:
        """Every control set (pauses, live limits): field to value."""
        return self.stamped_controls()[1]

    def stamped_controls(self) -> tuple[str | None, dict[str, str]]:
        """The controls' stamp (see :meth:`control_stamp`) and every control set."""
        with self.errors():
            raw = {_shown(k): _shown(v) for k, v in self._redis.hgetall(control_key(self.prefix)).items()}
        return raw.pop(CONTROL_STAMP, None), raw

    def control_stamp(self) -> str | None:
        """The controls' stamp (every write adds one to it: see :meth:`set_controls`),
        or None if no write ever stamped them."""
        return self.control_stamp_at()[0]

    def control_stamp_at(self) -> tuple[str | None, int, dict[str, str] | None]:
        """The controls' stamp, the Redis clock as it was read and, if no write stamped
        them, every control set (one round trip: a script, as a Redis Cluster client
        pipelines no TIME; a store far away pays it on each refresh)."""
        with self.errors():
            raw, (secs, micros), *whole = self._redis.eval(_STAMP_AND_TIME, 1, control_key(self.prefix), CONTROL_STAMP)
        now_us = int(self._clock()) if self._clock is not None else int(secs) * 1_000_000 + int(micros)
        if raw:
            return _shown(raw), now_us, None
        pairs = whole[0] if whole else []
        return None, now_us, {_shown(k): _shown(v) for k, v in zip(pairs[::2], pairs[1::2])}

    def set_control(self, field: str, value: str) -> None:
        self.set_controls({field: value})

    def set_controls(self, values: Mapping[str, str], clear: Sequence[str] = ()) -> list[Any]:
        """Set the controls ``values``, remove those named in ``clear`` and add one to the
        stamp, at once (MULTI, one round trip): a process that reads the same stamp after
        this has read what it wrote. Returns the replies (the stamp's last)."""
        with self.errors():
            pipe = self._redis.pipeline(transaction=True)
            if values:
                pipe.hset(control_key(self.prefix), mapping=dict(values))
            if clear:
                pipe.hdel(control_key(self.prefix), *clear)
            pipe.hincrby(control_key(self.prefix), CONTROL_STAMP, 1)
            return list(pipe.execute())


def _shown(value: bytes | str) -> str:
    """A control's name or value as text; bytes no codec reads replaced (a field written
    by hand is parsed, and may be logged, never written back)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
