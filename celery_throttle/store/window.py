"""The operations of a key's window, its line and its slots (a script per operation and
algorithm: lua/op/, after window.lua and line.lua).

One method per operation (its file in lua/op/ says what it does), each taking what the
script is told about the call as a :class:`.protocol.WindowCall`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ..core.errors import StoreError
from ..core.keys import adaptive_index_key, share_key, wake_key, window_keys
from ..core.protocol import (
    NO_ENTRY,
    REPLY_PLACES,
    Code,
    Cost,
    Counted,
    Entry,
    WindowCall,
    WindowReply,
    window_argv,
)
from ..core.state import FOREVER_US, STATE_FORMAT, STATE_LAYOUT, StateLayout
from ..core.timing import SCRIPT_POLICY, ScriptPolicy
from .compose import composed, pruned, script_parts, with_constants
from .index import WAKE_TTL_MS, IndexOps
from .scripts import text

__all__ = ["ALGORITHMS", "OPERATIONS", "WindowOps", "window_constants", "window_script"]

#: The algorithms of a window; each operation is a script per algorithm.
ALGORITHMS = ("sliding", "fixed")
#: Each operation of a key's window and line, and its file in lua/op/ ('screen' is an
#: 'acquire' that records nothing).
OPERATIONS = {"acquire": "acquire", "screen": "acquire", "admit": "admit", "front": "front", "claim": "claim",
              "release": "release", "drain": "drain", "drop": "drop", "ack": "ack", "give_back": "give_back",
              "settle": "settle", "ended": "ended", "renew": "renew", "peek": "peek", "shadow": "shadow",
              "take_back": "take_back"}
#: Keys whose line call failed a process remembers, to tell the index of them once the store
#: answers again (a Redis Cluster only); past it, the releasers' sweep finds the rest.
MOST_UNTOLD = 10_000
#: A message of a line (KEYS: its line, released entries, messages): its head's, else one of
#: the first released entries'. One round trip, not three: a store far away pays each.
_SAMPLE = """local ids = redis.call('ZRANGE', KEYS[1], 0, 0)
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, 3)) do ids[#ids + 1] = id end
for _, id in ipairs(ids) do
  local message = redis.call('HGET', KEYS[3], id)
  if message then return message end
end
return false"""


class WindowOps(IndexOps):
    """The window, line and index operations of a store."""

    def add_window_scripts(self, layout: StateLayout) -> None:
        """Register the window scripts (with this store's timing policy and ``layout``;
        each made when first run) and the index's."""
        self.add_lazy_scripts({f"{algorithm}/{op}": functools.partial(_window_script, algorithm, op, self.policy, layout)
                               for algorithm in ALGORITHMS for op in OPERATIONS})
        self.add_lua("adapt")
        #: Keys whose line call failed (on a Redis Cluster, where the caller tells the index):
        #: its reply lost, the index may never hear of its line (_tell_untold).
        self._untold: set[str] = set()

    def lower(self, key: str, law: tuple[float, float, float], window_us: int, reason: str,
              used: float = 1.0, unit: float = 0.0) -> tuple[float, float, bool]:
        """An adaptive throttle's downstream refused a call (``unit``: its share of the
        ceiling) with ``used`` (a share of the ceiling) of the key's starts in its window:
        state key ``key``'s level goes down by ``law`` (floor, decrease, growth), once per
        ``window_us``, and further ones in that window refine it (adapt.lua). Returns the
        level in force before, after, and whether this call lowered it (then the key joins
        the index of keys pushed back lately, which the gauges read)."""
        before, after, lowered = self.run("adapt", [key], [self.now_arg(), ",".join(map(repr, law)), window_us,
                                                           reason, repr(float(used)), repr(float(unit))])
        if lowered:
            # (Another hash tag than the key's: a call of its own, on a Cluster another node.)
            with self.errors():
                self._redis.zadd(adaptive_index_key(self.prefix), {key: self.now_us()})
        return float(before), float(after), bool(lowered)

    def pushed_back(self, most: int) -> list[tuple[str, bytes | None]]:
        """The state keys pushed back latest (``most`` at most), each with its last
        pushback as its hash holds it (field 'A'; None: gone)."""
        index = adaptive_index_key(self.prefix)
        with self.errors():
            keys = [text(k) for k in self._redis.zrevrange(index, 0, most - 1)]
            if not keys:
                return []
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.hget(key, "A")
            return list(zip(keys, pipe.execute()))

    def forget_pushed_back(self, keys: Sequence[str]) -> None:
        """These keys are back at their ceiling: out of the index of keys pushed back."""
        if keys:
            with self.errors():
                self._redis.zrem(adaptive_index_key(self.prefix), *keys)

    # -- windows and lines -------------------------------------------------------------
    # One method per operation (its file of lua/op/ says what it does).
    def window(self, key: str, op: str, call: WindowCall, *args: Any, cost: Cost | None = None) -> WindowReply:
        """Run operation ``op`` of window.lua on state key ``key`` for ``call``, with the
        operation's own ``args``."""
        if op not in OPERATIONS:
            raise ValueError(f"no window operation {op!r} (one of {', '.join(OPERATIONS)})")
        if self.index_parts == 1:  # (a single Redis: the script tells the index of its key itself)
            keys: tuple[str, ...] = (*window_keys(key), share_key(key), *self.index_keys(0), wake_key(self.prefix))
        else:
            keys = (*window_keys(key), share_key(key)) if call.shared else window_keys(key)
        try:
            raw = self.run(f"{call.algorithm}/{op}", keys, window_argv(self.now_arg(), op, call, *args, cost=cost))
        except StoreError:
            if self.index_parts > 1 and op != "peek" and len(self._untold) < MOST_UNTOLD:
                self._untold.add(key)
            raise
        reply = WindowReply.of(raw)
        if self._untold:
            self._tell_untold(reply.now_us)
        return reply

    def _tell_untold(self, now_us: int) -> None:
        """On a Redis Cluster, the keys whose line call failed since the store last
        answered are due now in the index (a releaser's look settles each as it is): a call
        that ran and whose reply was lost said "tell the index" to nobody, and the key's
        line would wait for the releasers' sweep. (On a single Redis the script tells it.)"""
        while self._untold:
            try:
                key = self._untold.pop()
            except KeyError:
                return  # (another thread took the last)
            try:
                self.index_note(key, now_us, now_us)
            except StoreError:
                self._untold.add(key)
                return

    def acquire(self, key: str, call: WindowCall, *, lease: int = 0, lease_span_us: int = 0, holder: str = "",
                entry: Entry = NO_ENTRY) -> WindowReply:
        """A fresh call: ``RUN`` (recorded; a lease of ``lease`` units for calls to come
        within ``lease_span_us`` if nothing waits and every rate stays at most half full;
        with a concurrency limit, a slot for ``holder``), else ``QUEUED`` in the key's line
        with ``entry``'s message, ``DENIED`` without one, ``TOO_FAR`` past its max wait."""
        return self.window(key, "acquire", call, lease, lease_span_us, holder, *entry.args())

    def screen(self, key: str, call: WindowCall, entry: Entry = NO_ENTRY) -> WindowReply:
        """As :meth:`acquire`, but a call that fits is not recorded (the pool's acquire will)."""
        return self.window(key, "screen", call, 0, 0, "", *entry.args())

    def admit(self, key: str, call: WindowCall, entry: Entry) -> WindowReply:
        """At publish: ``RUN`` (nothing recorded) if nothing waits and every rate stays at
        most half full; else ``RELEASED`` if it fits now (``entry.id`` is its ticket), else
        as :meth:`acquire`."""
        return self.window(key, "admit", call, *entry.args())

    def front(self, key: str, call: WindowCall, entry: Entry) -> WindowReply:
        """``entry`` joins the line before everyone (a task that backs off)."""
        return self.window(key, "front", call, *entry.args())

    def claim(self, key: str, call: WindowCall, ticket: str, *, early_us: int, holder: str, granted_us: int = 0,
              entry: Entry = NO_ENTRY, stale_ok: bool = False) -> WindowReply:
        """A released task arrives with ``ticket``: ``RUN``, ``RUN_AT`` (at most ``early_us``
        before its start), back in line (``QUEUED``; ``DENIED`` if no message is kept nor
        given), ``WAITED``; an unknown ticket is a fresh call (``holder``, ``entry``).
        ``granted_us``: the start granted to this process before, which it woke too late for.
        ``stale_ok``: answer ``STALE`` rather than send it back under other controls than
        it was released under."""
        return self.window(key, "claim", call, ticket, early_us, holder, granted_us, *entry.args(),
                           "1" if stale_ok else "0")

    def release(self, key: str, call: WindowCall, batch: int, sent: Sequence[str] = ()) -> WindowReply:
        """Release the heads of the key's line that fit (the releasers), once the tasks
        released with ``sent`` are acked (as :meth:`ack`: sent since the last release)."""
        return self.window(key, "release", call, batch, *sent)

    def drain(self, key: str, call: WindowCall, batch: int, sent: Sequence[str] = ()) -> WindowReply:
        """Release the heads of the key's line whatever the room (``sent``: as :meth:`release`)."""
        return self.window(key, "drain", call, batch, *sent)

    def ack(self, key: str, call: WindowCall, tickets: Sequence[str]) -> WindowReply:
        """The tasks released with ``tickets`` were sent to the broker."""
        return self.window(key, "ack", call, *tickets)

    def give_back(self, key: str, call: WindowCall, ticket: str, batch: int, handed_back: bool = False,
                  shadowed: bool = False) -> WindowReply:
        """The task released with ``ticket`` will not start: its room comes back.
        ``handed_back``: one never acked goes back in its place (its worker had no process
        for it), to be released again at once. ``shadowed``: it starts in shadow mode,
        outside the rules: its room comes back and it is used (DUPLICATE: it already was)."""
        how = "2" if shadowed else "1" if handed_back else "0"
        return self.window(key, "give_back", call, ticket, batch, how)

    def settle(self, key: str, call: WindowCall, counted: Counted, delta: Cost, batch: int) -> WindowReply:
        """A call that started, counted as ``counted``, reports its real cost: ``delta``
        more units (negative: fewer) in the span it was counted in."""
        return self.window(key, "settle", call, counted.start_us, counted.latest_us, counted.epoch, batch,
                           cost=delta)

    def ended(self, key: str, call: WindowCall, holder: str, batch: int) -> WindowReply:
        """A body ended: ``holder``'s slot goes (``LOST``: its lease had run out)."""
        return self.window(key, "ended", call, holder, batch)

    def renew(self, key: str, call: WindowCall, holders: Sequence[str]) -> WindowReply:
        """Extend the slot leases of ``holders``; those lost come back in ``reported``."""
        return self.window(key, "renew", call, *holders)

    def drop(self, key: str, call: WindowCall, entries: Sequence[str]) -> WindowReply:
        """Delete ``entries`` waiting in the key's line (an operator's purge)."""
        return self.window(key, "drop", call, *entries)

    def take_back(self, key: str, call: WindowCall, lined: Sequence[str], out: Sequence[str]) -> WindowReply:
        """These entries left the key's line for good (the journal says so): each the store
        holds again released and not acked, or (``lined``) in its line, leaves (reported
        ``k``)."""
        return self.window(key, "take_back", call, len(lined), *lined, *out)

    def peek(self, key: str, call: WindowCall) -> WindowReply:
        """Usage and the line, recording nothing."""
        return self.window(key, "peek", call)

    def shadow(self, key: str, call: WindowCall, holder: str, max_wait_us: int) -> WindowReply:
        """A call in shadow mode, on shadow state key ``key``: where enforcing would have
        started it (``start``; DENIED with its ``wait`` if later than now), recorded there;
        ``holder`` joins the shadow slots with a concurrency limit (``held``)."""
        return self.window(key, "shadow", call, holder, max_wait_us)

    def sample(self, key: str) -> bytes | None:
        """A message of ``key``'s line: its head's, else one released and not started."""
        _, _, line, msgs, out, _, _ = window_keys(key)
        with self.errors():
            message = self._redis.eval(_SAMPLE, 3, line, out, msgs)
        return bytes(message) if message else None

    def slot_holders(self, key: str, match: str) -> list[str]:
        """The holders of ``key``'s concurrency slots whose names match ``match`` (ZSCAN)."""
        with self.errors():
            return [text(h) for h, _ in self._redis.zscan_iter(window_keys(key)[5], match=match)]


def window_script(algorithm: str, op: str, policy: ScriptPolicy = SCRIPT_POLICY,
                  layout: StateLayout = STATE_LAYOUT) -> str:
    """The script of window operation ``op`` (:data:`OPERATIONS`) of ``algorithm``."""
    return _window_script(algorithm, op, policy, layout)[0]


def window_constants(policy: ScriptPolicy = SCRIPT_POLICY, layout: StateLayout = STATE_LAYOUT) -> dict[str, int]:
    """The constants the window scripts read, by name: the timing policy, the state layout,
    the reply codes and each field's place in a reply, the state format."""
    return {**policy.values(), **layout.values(), **{code.name: int(code) for code in Code}, **REPLY_PLACES,
            "STATE_FORMAT": STATE_FORMAT, "FOREVER_US": FOREVER_US, "WAKE_TTL_MS": WAKE_TTL_MS}


@functools.cache
def _window_script(algorithm: str, op: str, policy: ScriptPolicy,
                   layout: StateLayout) -> tuple[str, list[tuple[int, str]]]:
    """The script of ``op`` and where each of its lines comes from: its algorithm,
    window.lua, line.lua and lua/op/, with the constants written in and every function it
    does not reach blanked (compose.py says why). Made once per process (a few ms each)."""
    source, lines = composed(script_parts(f"{algorithm}.lua", "window.lua", "line.lua", f"op/{OPERATIONS[op]}.lua"))
    return pruned(with_constants(source, window_constants(policy, layout))), lines
