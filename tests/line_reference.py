"""A pure-Python twin of window.lua with line.lua: one key's windows, its line, the tasks
released from it and not started, and its concurrency slots.

``KeyModel`` does what the script does, function by function (``earliest``, ``estimate``,
``expire_out``, ``release_heads``, ``next_due``, ``finish`` and each operation), on the
rates of ``tests.reference`` (``SlidingRate``, ``FixedRate``: the algorithms' twins), under
the same timing policy and layout. ``tests/script/test_line_model.py`` runs both through random
walks and compares every reply and everything stored. Times are integer microseconds.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_throttle.core.protocol import Code
from celery_throttle.core.state import STATE_LAYOUT, StateLayout
from celery_throttle.core.timing import SCRIPT_POLICY, ScriptPolicy
from tests.reference import FixedRate, SlidingRate

__all__ = ["FOREVER_US", "KeyModel", "Meta", "Rates"]

FOREVER_US = 2**53 - 1
_ALGORITHMS = {"sliding": SlidingRate, "fixed": FixedRate}

#: (limit, period µs, unit) of each rate, in the order the script is told them.
Rates = tuple[tuple[int, int, str], ...]


@dataclass
class Meta:
    """What the script keeps of an entry (KEYS[4], entry .. '#'), field by field."""

    task: str
    units: dict[str, int]
    enqueued: int
    expires: int
    max_wait: int
    place: int = 0
    phase: str = "w"
    released: int = 0
    start: int = 0
    latest: int = 0
    #: The epoch of the windows a start granted ahead was counted in.
    epoch: int = 0
    #: The controls it was released under (None: never released).
    controls: str | None = None

    def stored(self) -> list[Any]:
        flat: list[Any] = []
        for unit in sorted(self.units):
            flat += [unit, self.units[unit]]
        fields = [self.task, flat, self.enqueued, self.expires, self.max_wait, self.place, self.phase, self.released,
                  self.start, self.latest, self.epoch]
        return fields if self.controls is None else [*fields, self.controls]


@dataclass
class Call:
    """One call as the script is told it: its rates, cost, and the head of the ARGV."""

    rates: Rates
    #: The state's field of each rate (a live limit keeps a declared rate's).
    fields: tuple[str, ...]
    costs: tuple[int, ...]
    uniform: bool
    slack: int
    not_before: int
    concurrency: int
    slot_lease: int
    lead_default: int
    #: The concurrency is the scope's, shared: the key holds its cap (KeyModel.share_cap).
    shared: bool = False
    #: When the controls of the call were read (ARGV[9]; 0: unknown).
    read: int = 0


@dataclass
class _Reply:
    code: int
    wait: int = 0
    remaining: int = 0
    clear_at: int = 0
    now: int = 0
    epoch: int = 0
    lead: int = 0
    leased: int = 0
    rooms: str = ""
    start: int = 0
    latest: int = 0
    waiting: int = 0
    out: int = 0
    running: int = 0
    due: int = 0
    index: int = 0
    waited: int = 0
    held: int = 0
    slot_cap: int = 0
    reported: list[tuple[str, Any, str]] = field(default_factory=list)

    def as_tuple(self) -> tuple[Any, ...]:
        return (self.code, self.wait, self.remaining, self.clear_at, self.now, self.epoch, self.lead, self.leased,
                self.rooms, self.start, self.latest, self.waiting, self.out, self.running, self.due, self.index,
                self.waited, self.held, self.slot_cap, tuple(self.reported))


class KeyModel:
    """Everything one (scope, key) holds in the store, and the script's operations on it."""

    def __init__(self, algorithm: str, *, policy: ScriptPolicy = SCRIPT_POLICY,
                 layout: StateLayout = STATE_LAYOUT) -> None:
        self.algorithm = algorithm
        self.policy = policy
        self.layout = layout
        #: The windows, by field name (a field keeps its state whatever rates a call names).
        self.windows: dict[str, SlidingRate | FixedRate] = {}
        self.epoch: int | None = None
        self.delay: int | None = None
        self.jitter: int | None = None
        # the line
        self.line: dict[str, int] = {}
        self.messages: dict[str, bytes] = {}
        self.meta: dict[str, Meta] = {}
        self.out: dict[str, int] = {}
        self.slots: dict[str, int] = {}
        #: Entries that started lately (KEYS[7]): entry -> when.
        self.used: dict[str, int] = {}
        #: A lost start this call took back (see _unuse), until it ends.
        self.unused: tuple[str, int, str, int | None] | None = None
        # the line's counts (KEYS[2]), present while something waits or is out
        self.waiting = 0
        self.last_place = 0
        self.first_place = 0
        self.out_units: dict[str, int] = {}
        self.line_units: dict[str, int] = {}
        self.out_count = 0
        self.indexed = 0
        self.indexed_at = 0
        #: The key's cap in its scope's share (KEYS[8], written by the sharer; 0: none), and
        #: the slots it may hold in the call being run.
        self.share_cap = 0
        self.slot_cap = 0
        #: KEYS[2] was evicted since the last call, the entries staying (see lose_counts).
        self.counts_lost = False
        #: The index of lines as it holds this key (index.lua; on a single Redis each call
        #: tells it itself, line.lua's tell_index): its due time (None: not in it), when
        #: that was computed, its last wake-up, and the releasers' wake-ups pushed.
        self.writes_index = False
        self.index_due: int | None = None
        self.index_at: int | None = None
        self.woken: int | None = None
        self.wakes: list[str] = []
        #: On a key's shadow keys (line.lua's shadow): the last start given ('l'), and the
        #: counts 'n' (checked), 'h' (held back), 'w' (µs waited in all), 'm' (the longest).
        self.shadow_last = 0
        self.shadow_counts = {"n": 0, "h": 0, "w": 0, "m": 0}

    def lose_counts(self) -> None:
        """The line's counts (KEYS[2]) are evicted, its entries stay: the next call counts
        them again from the entries (line.lua), and tells the index of the key."""
        self.counts_lost = True

    def _count_again(self) -> None:
        self.counts_lost = False
        self.waiting, self.out_count = len(self.line), len(self.out)
        self.first_place = min(0, math.floor(min(self.line.values(), default=0)))
        self.last_place = max(0, self._last_given(max(self.line.values(), default=0)),
                              *(self._last_given(self.meta[i].place) for i in self.out if i in self.meta))
        self.line_units, self.out_units = {}, {}
        for eid in self.line:
            m = self.meta.get(eid)
            self._add(self.line_units, m.units if m is not None else self.call_by_unit, 1)
        for eid in self.out:
            m = self.meta.get(eid)
            if m is not None and m.phase != "g":
                self._add(self.out_units, m.units, 1)
        self.indexed = self.indexed_at = 0
        self.existed = False  # (the script read no counts: to it, the line began)

    def reset_windows(self) -> None:
        """The state hash is gone (a reset, its TTL): its windows, epoch and learnt delay."""
        self.windows, self.epoch, self.delay, self.jitter = {}, None, None, None

    # -- the run of one call ---------------------------------------------------------------
    def run(self, now: int, op: str, call: Call, *args: Any, delta: tuple[int, ...] | None = None) -> _Reply:
        """One run of the script: ``op`` with its own ``args`` (as its file of lua/op/ lists them)."""
        lost = self.counts_lost
        # (The entry's urgency, [E+7]: taken out of the args here, read by _enqueue.)
        at = {"acquire": 10, "screen": 10, "admit": 7, "front": 7, "claim": 11}.get(op)
        self.urgency = 0
        if at is not None and len(args) > at:
            most = self.policy.most_urgency
            self.urgency = max(-most, min(most, math.floor(int(args[at]))))
            args = args[:at] + args[at + 1:]
        self._begin(now, call)
        if op == "peek":
            self.counts_lost = lost  # (it writes nothing: the counts stay lost, counted again each call)
        if op == "settle":
            return self._settle(delta or (), *args)
        handler = {"ack": self._ack, "ended": self._ended, "renew": self._renew, "release": self._release,
                   "drain": self._drain, "give_back": self._give_back, "take_back": self._take_back}.get(op)
        if handler is not None:
            return handler(*args)
        if op == "claim":
            return self._claim(*args)
        for r, c in zip(self.rates, call.costs):
            if c > r.limit:
                self.counts_lost = lost  # (refused before it reads anything: nothing written)
                return _Reply(Code.TOO_COSTLY, now=now, lead=-1, slot_cap=self.slot_cap)
        handler = {"acquire": lambda *a: self._acquire(True, *a), "screen": lambda *a: self._acquire(False, *a),
                   "admit": self._admit, "front": self._front, "peek": self._peek, "shadow": self._shadow}[op]
        return handler(*args)

    def _begin(self, now: int, call: Call) -> None:
        self.now, self.call = now, call
        # (a shared K: the key's cap, KEYS[8], as the sharer wrote it; none: 0)
        self.slot_cap = max(min(call.concurrency, self.share_cap), 0) if call.shared else call.concurrency
        self.not_before = call.not_before if call.not_before > now else 0
        self.rates: list[SlidingRate | FixedRate] = []
        self.units_of_rate: list[str] = []
        for (limit, period, unit), name in zip(call.rates, call.fields):
            r = self.windows.get(name)
            if r is None or (r.limit, r.period) != (limit, period):
                # (a live rate of this window's length under another limit counts its units)
                old = r
                r = _ALGORITHMS[self.algorithm](limit, period, self.layout, unit)
                if old is not None:
                    r.__dict__.update({k: v for k, v in old.__dict__.items() if k not in ("limit",)})
                    r.limit = limit
            r.field = name
            r.load(now)
            self.windows[name] = r
            self.rates.append(r)
            self.units_of_rate.append(name.rpartition(".")[2] if "." in name else "")
        self.dirty: set[int] = set()
        self.shortest = min((r.period for r in self.rates), default=1_000_000)
        self.half_pace = min((math.floor(r.period / r.limit / 2) for r in self.rates), default=0)
        self.existed = self.waiting > 0 or self.out_count > 0
        self.reported: list[tuple[str, Any, str]] = []
        self.call_by_unit = {unit: c for unit, c in zip(self.units_of_rate, call.costs)}
        if self.counts_lost:
            self._count_again()

    # -- what every operation shares --------------------------------------------------------
    def lead(self) -> int:
        if self.delay is None or self.jitter is None:
            return self.call.lead_default
        return self.delay + min(self.policy.lead_jitters * self.jitter, self.half_pace)

    def _record(self, at: int, latest: int, units: list[int] | tuple[int, ...]) -> None:
        for i, (r, u) in enumerate(zip(self.rates, units)):
            r.record(at, latest, u)
            self.dirty.add(i)

    def _unrecord(self, at: int, span: int, units: list[int] | tuple[int, ...]) -> None:
        for i, (r, u) in enumerate(zip(self.rates, units)):
            r.unrecord(at, span, u)
            self.dirty.add(i)

    def _write_back(self) -> None:
        dirty = [self.rates[i] for i in sorted(self.dirty)]
        self.dirty = set()
        for r in dirty:
            r.fold(self.now)
        if self.epoch is None and any(r.holds_units() for r in dirty):
            self.epoch = self.now

    def _earliest(self, start: int, units: list[int] | tuple[int, ...], beside: list[int] | None) -> int | None:
        x = start
        for _ in range(self.policy.settle_rounds):
            settled = True
            for i, r in enumerate(self.rates):
                need = units[i] + (beside[i] if beside else 0)
                if need > r.limit:
                    return None
                e = r.earliest(x, need, self.call.slack)
                if e > x:
                    x, settled = e, False
            if settled:
                return x
        return None

    def _estimate(self, start: int, units: list[int], ahead: list[int]) -> int:
        t = start
        for i, r in enumerate(self.rates):
            total = units[i] + ahead[i]
            windows = math.floor((total - 1) / r.limit)
            e = r.earliest(start, total - windows * r.limit, self.call.slack) + windows * r.period
            t = max(t, e)
        return t

    def _lease_units(self, i: int, n: int) -> int:
        return n if self.call.uniform else n * self.call.costs[i]

    def _lease_fits(self, n: int | None, span: int) -> bool:
        for i, r in enumerate(self.rates):
            u = self._lease_units(i, n) if n is not None else self.call.costs[i]
            used = max(r.usage(self.now), r.usage(self.now + span))
            if 2 * (used + u) > r.limit:
                return False
            if r.earliest(self.now, u, span) != self.now:
                return False
        return True

    def _remaining(self) -> int:
        free = min((r.limit - r.usage(self.now) - self.out_units.get(u, 0)
                    for r, u in zip(self.rates, self.units_of_rate)), default=0)
        return max(free, 0)

    def _clear_at(self) -> int:
        return max((r.clear_at() for r in self.rates), default=0)

    # -- the line -------------------------------------------------------------------------
    def _units_of(self, m: Meta) -> list[int]:
        return [m.units.get(u, 1) for u in self.units_of_rate]

    def _out_per_rate(self, own: list[int] | None = None) -> list[int]:
        return [self.out_units.get(u, 0) - (own[i] if own else 0) for i, u in enumerate(self.units_of_rate)]

    @staticmethod
    def _add(table: dict[str, int], units: dict[str, int], sign: int) -> None:
        for unit, n in units.items():
            v = table.get(unit, 0) + sign * n
            if v > 0:
                table[unit] = v
            else:
                table.pop(unit, None)

    def _slots_held(self) -> int:
        return len(self.slots)

    def _slot_free(self) -> bool:
        return self.call.concurrency == 0 or self._slots_held() < self.slot_cap

    def _reclaim(self) -> None:
        self.slots = {h: t for h, t in self.slots.items() if t > self.now}

    def _hold(self, holder: str, until: int, handed: str | None) -> int:
        had = handed is not None and self.slots.pop(handed, None) is not None
        if self.call.concurrency > 0 or had or holder in self.slots:
            self.slots[holder] = until
            return 1
        return 0

    def _join(self, eid: str, m: Meta, place: int) -> None:
        m.place, m.phase = place, "w"
        self.meta[eid] = m
        self.line[eid] = place
        self.waiting += 1
        self._add(self.line_units, m.units, 1)

    def _leave(self, eid: str, m: Meta | None) -> None:
        if self.line.pop(eid, None) is not None:
            self.waiting -= 1
            if m is not None:
                self._add(self.line_units, m.units, -1)

    def _new_meta(self, task: str, expires: int, max_wait: int) -> Meta:
        return Meta(task, dict(self.call_by_unit), self.now, expires, max_wait)

    def _place_of(self, given: int, urgency: int) -> float:
        if urgency == 0:
            return given
        return given - urgency * self.policy.priority_step - (0.5 if urgency > 0 else -0.5)

    def _last_given(self, place: float) -> float:
        return place if place == math.floor(place) else math.floor(place) + self.policy.most_urgency * \
            self.policy.priority_step + 1

    def _front_place(self) -> int:
        head = min(self.line.values(), default=None)
        self.first_place = min(self.first_place, math.floor(head if head is not None else 0)) - 1
        return self.first_place

    def _enqueue(self, eid: str, message: bytes, m: Meta, front: bool) -> None:
        if front:
            place: float = self._front_place()
        else:
            self.last_place += 1
            place = self._place_of(self.last_place, self.urgency)
        self.messages[eid] = message
        self._join(eid, m, place)

    def _controls_seen(self) -> str:
        """The controls of this call as they bear on a start: the pause, K, each rate."""
        return ",".join(str(v) for v in (self.not_before, self.call.concurrency,
                                           *(x for r in self.rates for x in (r.limit, r.period))))

    def _go_out(self, eid: str, m: Meta, phase: str, until: int) -> None:
        m.phase, m.released, m.controls = phase, self.now, self._controls_seen()
        self.meta[eid] = m
        self.out[eid] = until
        self.out_count += 1
        self._add(self.out_units, m.units, 1)
        if self.call.concurrency > 0:
            self.slots[eid] = min(until, self.now + self.policy.handed_slot_ms * 1000)

    def _come_in(self, eid: str, m: Meta) -> None:
        if self.out.pop(eid, None) is not None:
            self.out_count -= 1
            if m.phase != "g":
                self._add(self.out_units, m.units, -1)

    def _ungrant(self, m: Meta) -> None:
        if m.phase == "g" and m.epoch == (self.epoch or 0):
            self._unrecord(m.start, m.latest - m.start, self._units_of(m))

    def _used(self, eid: str) -> bool:
        return bool(eid) and eid in self.used

    def _use(self, eid: str, holder: str) -> None:
        cut = self.now - self.policy.used_keep_ms * 1000
        self.used = {e: t for e, t in self.used.items() if t > cut}
        self.used[eid] = self.now
        nonce = re.search(r":([0-9a-fA-F]+)$", holder)
        if nonce:
            self.used[f"{eid}@{nonce.group(1)}"] = self.now

    def _lost_start(self, eid: str, lost: str) -> bool:
        """Entry ``eid`` was started lately by delivery ``lost``, whose reply was lost."""
        return bool(lost) and bool(eid) and f"{eid}@{lost}" in self.used

    def _unuse(self, eid: str, lost: str, holder: str) -> None:
        member = f"{eid}@{lost}"
        self.unused = (member, self.used.pop(member), holder, self.slots.pop(holder, None))

    def _keep_unused(self, code: int) -> None:
        """A call that changes nothing (DENIED, STALE) puts back the lost start it took."""
        if self.unused is not None and code in (Code.DENIED, Code.STALE):
            member, at, lost, until = self.unused
            self.used[member] = at
            if until is not None:
                self.slots[lost] = until
        self.unused = None

    def _forget(self, eid: str) -> None:
        self.messages.pop(eid, None)
        self.meta.pop(eid, None)

    @staticmethod
    def _zrange(table: dict[str, int], upto: int | None = None, limit: int | None = None) -> list[str]:
        """Members by score, then member (bytes order), as ZRANGE answers."""
        items = sorted(table.items(), key=lambda kv: (kv[1], kv[0].encode()))
        ids = [k for k, v in items if upto is None or v <= upto]
        return ids[:limit] if limit is not None else ids

    def _expire_out(self, batch: int) -> None:
        for eid in self._zrange(self.out, self.now, batch):
            m = self.meta.get(eid)
            if m is None:
                self.out.pop(eid)
                self.out_count -= 1
                self.slots.pop(eid, None)
                self._forget(eid)
            elif m.phase == "g":
                self._come_in(eid, m)
                self._forget(eid)
            else:
                self._come_in(eid, m)
                self.slots.pop(eid, None)
                if m.phase == "s" and eid in self.messages:
                    self._join(eid, m, m.place)
                else:
                    self._forget(eid)
                    self.reported.append((eid, m.task, "f"))

    def _release_heads(self, batch: int, anyway: bool = False) -> None:
        looked, lead_now = 0, self.lead()
        while looked < batch and self.waiting > 0:
            looked += 1
            heads = self._zrange(self.line)
            if not heads:
                self.waiting = 0
                break
            head = heads[0]
            m = self.meta.get(head)
            message = self.messages.get(head)
            if m is None or message is None:
                self._leave(head, m)
                self._forget(head)
                self.reported.append((head, m.task if m else head, "l"))
            elif 0 < m.expires <= self.now:
                self._leave(head, m)
                self._forget(head)
                self.reported.append((head, message, "x"))
            elif any(u > r.limit for u, r in zip(self._units_of(m), self.rates)):
                self._leave(head, m)
                self._forget(head)
                self.reported.append((head, message, "c"))
            else:
                if not anyway:
                    if self.not_before > 0 or not self._slot_free():
                        break
                    at = self._earliest(self.now, self._units_of(m), self._out_per_rate())
                    if at is None or at > self.now + lead_now:
                        break
                self._leave(head, m)
                self._go_out(head, m, "s", self.now + self.policy.send_lease_ms * 1000)
                self.reported.append((head, message, "r"))

    def _next_due(self) -> int:
        due: int | None = None

        def at(t: int) -> None:
            nonlocal due
            if due is None or t < due:
                due = t

        if self.waiting > 0:
            heads = self._zrange(self.line)
            m = self.meta.get(heads[0]) if heads else None
            if m is None:
                at(self.now)
            else:
                if m.expires > 0:
                    at(m.expires)
                if self.not_before > 0:
                    at(max(self.not_before - self.lead(), self.now))
                elif not self._slot_free():
                    first = self._zrange(self.slots)
                    if first:
                        at(self.slots[first[0]])
                else:
                    x = self._earliest(self.now, self._units_of(m), self._out_per_rate())
                    if x is not None:
                        at(max(x - self.lead(), self.now))
        first_out = self._zrange(self.out)
        if first_out:
            at(self.out[first_out[0]])
        if due is None and (self.waiting > 0 or self.out_count > 0):
            due = FOREVER_US
        if due is None and self.existed:
            due = self.now
        return due or 0

    def _finish(self, code: int, wait: int, f: dict[str, Any] | None = None, release_op: bool = False,
                readonly: bool = False) -> _Reply:
        f = f or {}
        self._keep_unused(code)
        if not readonly:
            self._write_back()
        due, index = self._next_due(), 0
        if not readonly:
            if self.waiting == 0 and self.out_count == 0:
                self.last_place = self.first_place = 0
                self.out_units, self.line_units = {}, {}
                self.indexed = self.indexed_at = 0
                if self.existed and not release_op:
                    index = 1
            else:
                if not self.existed:
                    index = 2
                elif due > 0 and (self.indexed == 0 or due < self.indexed
                                  or self.indexed_at < self.now - self.policy.index_stale_ms * 1000):
                    index = 1
                if release_op:
                    index = 0
                if index > 0 or release_op:
                    self.indexed, self.indexed_at = due, self.now
            if index > 0 and self.writes_index:
                self._tell_index(due, emptied=self.waiting == 0 and self.out_count == 0)
                index = 0
        return _Reply(code, wait, self._remaining(), self._clear_at(), self.now, self.epoch or 0, self.lead(),
                      f.get("leased", 0), f.get("rooms", ""), f.get("start", 0), f.get("latest", 0), self.waiting,
                      self.out_count, self._slots_held(), due, index, f.get("waited", 0), f.get("held", 0),
                      self.slot_cap, self.reported)

    # -- the index of lines (index.lua), as it holds this key --------------------------------
    def _tell_index(self, due: int, emptied: bool) -> None:
        """line.lua's tell_index: index.lua's note of this call's due time (an emptied line
        leaves the index), and a releaser woken if its look is soon."""
        if self.now < (self.index_at or 0):
            return
        if emptied:
            self.index_due = self.index_at = self.woken = None
            return
        read = self.call.read
        if read and read < (self.woken or 0) and self.index_due is not None and due > self.index_due:
            return
        self.index_due, self.index_at = due, self.now
        if due - self.now < self.policy.wake_ahead_ms * 1000:
            self.wakes.append(f"p0@{due}" if due > self.now else "p0")

    def settle_index(self, now: int, due: int, at: int, read: int) -> None:
        """index.lua's settle of this key by a releaser (due 0: nothing waits)."""
        if read and read < (self.woken or 0) and (due == 0 or due > now):
            due = now
        if at >= (self.index_at or 0):
            if due == 0:
                self.index_due = self.index_at = self.woken = None
            else:
                self.index_due, self.index_at = due, at

    def wake_index(self, now: int) -> None:
        """index.lua's wake: the key, if held, is due now (never later than it was)."""
        if self.index_due is not None:
            self.index_due = min(self.index_due, now)
            self.index_at = self.woken = now

    def _wait_of(self, units: list[int]) -> int:
        ahead = [self.line_units.get(u, 0) + self.out_units.get(u, 0) for u in self.units_of_rate]
        return self._estimate(max(self.now, self.not_before), units, ahead) - self.now

    # -- the operations ---------------------------------------------------------------------
    def _wait_in_line(self, eid: str, message: bytes, task: str, expires: int, max_wait: int,
                      front: bool) -> tuple[int, int]:
        wait = self._wait_of(list(self.call.costs))
        if max_wait > 0 and self.call.concurrency == 0 and wait > max_wait:
            return Code.TOO_FAR, wait
        if message == b"":
            return Code.DENIED, wait
        self._enqueue(eid, message, self._new_meta(task, expires, max_wait), front)
        return Code.QUEUED, wait

    def _fresh_fits(self) -> bool:
        return (self.waiting == 0 and self.not_before == 0 and self._slot_free()
                and self._earliest(self.now, self.call.costs, self._out_per_rate()) == self.now)

    def _fresh(self, runs: bool, lease: int, lease_span: int, holder: str, eid: str, message: bytes, task: str,
               expires: int, max_wait: int, batch: int, lost_by: str = "", again: bool = False) -> _Reply:
        code, wait, f = Code.RUN, 0, {}
        lost = not again and self._lost_start(eid, lost_by)
        out_m = self.meta.get(eid) if eid and eid in self.out else None
        if out_m is not None and out_m.phase != "g" and eid not in self.line:
            # (a copy of a task released from the line naming its entry: that task arriving)
            if runs:
                self._write_back()
                return self._arrive(eid, 0, holder, 0, eid, message, task, expires, max_wait, batch, lost_by, "0")
            self._release_heads(batch)
            return self._finish(Code.RUN, 0, f)
        if eid and eid in self.meta:
            code = Code.QUEUED
        elif not again and self._used(eid) and not lost:
            code = Code.DUPLICATE
        elif lost and runs:
            self._unuse(eid, lost_by, holder)
            return self._fresh(runs, lease, lease_span, holder, eid, message, task, expires, max_wait, batch, lost_by,
                               True)
        elif self._fresh_fits():
            if runs:
                units, span = list(self.call.costs), self.call.slack
                one = self.call.costs[0] if self.call.uniform and self.call.costs else 1
                if lease > one and self.out_count == 0 and self.call.concurrency == 0:
                    wide = max(lease_span, self.call.slack)
                    if self._lease_fits(lease, wide):
                        units, span, f["leased"] = [self._lease_units(i, lease) for i in range(len(self.rates))], \
                            wide, lease
                self._record(self.now, self.now + span, units)
                if again:
                    self._use(eid, holder)
                if self.call.concurrency > 0:
                    self.slots[holder] = self.now + self.call.slot_lease
                    f["held"] = 1
        else:
            code, wait = self._wait_in_line(eid, message, task, expires, max_wait, False)
        self._release_heads(batch)
        return self._finish(code, wait, f)

    def _acquire(self, runs: bool, lease: int, lease_span: int, holder: str, eid: str, message: bytes, task: str,
                 expires: int, max_wait: int, batch: int, lost: str = "") -> _Reply:
        self._expire_out(self.policy.line_batch)
        self._reclaim()
        return self._fresh(runs, lease, lease_span, holder, eid, message, task, expires, max_wait, batch, lost)

    def _admit(self, eid: str, message: bytes, task: str, expires: int, max_wait: int, batch: int,
               lost: str = "") -> _Reply:
        self._expire_out(self.policy.line_batch)
        self._reclaim()
        code, wait, f = Code.RUN, 0, {}
        if eid and eid in self.meta:
            code = Code.QUEUED
        elif self._used(eid):
            code = Code.DUPLICATE
        elif (not message and self.waiting == 0 and self.out_count == 0 and self.not_before == 0
                and self._slot_free() and self._lease_fits(None, self.call.slack)):
            rooms = [math.floor(r.limit / 2) - max(r.usage(self.now), r.usage(self.now + self.call.slack))
                     for r in self.rates]
            room = min(rooms, default=None)
            if self.call.concurrency > 0 and not self.rates:
                room = max(self.slot_cap - self._slots_held(), 0)
            f["leased"] = room or 0
            f["rooms"] = ",".join(map(str, rooms)) if not self.call.uniform else ""
        elif self._fresh_fits():
            code = Code.RELEASED
            self._go_out(eid, self._new_meta(task, expires, max_wait), "o",
                         self.now + self.policy.out_lease_ms * 1000)
        else:
            code, wait = self._wait_in_line(eid, message, task, expires, max_wait, False)
        self._release_heads(batch)
        return self._finish(code, wait, f)

    def _front(self, eid: str, message: bytes, task: str, expires: int, max_wait: int, batch: int,
               lost: str = "") -> _Reply:
        self._expire_out(self.policy.line_batch)
        if eid not in self.meta:
            self._enqueue(eid, message, self._new_meta(task, expires, max_wait), True)
        self._release_heads(batch)
        return self._finish(Code.QUEUED, 0)

    def _claim(self, ticket: str, early_cap: int, holder: str, granted: int, eid: str, message: bytes, task: str,
               expires: int, max_wait: int, batch: int, lost: str = "", stale_ok: str = "0") -> _Reply:
        self._expire_out(self.policy.line_batch)
        self._reclaim()
        return self._arrive(ticket, early_cap, holder, granted, eid, message, task, expires, max_wait, batch,
                            lost, stale_ok)

    def _arrive(self, ticket: str, early_cap: int, holder: str, granted: int, eid: str, message: bytes, task: str,
                expires: int, max_wait: int, batch: int, lost_by: str, stale_ok: str) -> _Reply:
        early = min(early_cap, max(2 * self.lead(), 4 * self.call.slack))
        snapshot = copy.deepcopy(self.windows)
        m = self.meta.get(ticket) if ticket in self.out else None
        in_line = False
        if m is None and ticket in self.line:
            m = self.meta.get(ticket)
            in_line = m is not None
        lost = self._lost_start(ticket, lost_by)
        if lost:
            self._unuse(ticket, lost_by, holder)
            if m is not None and m.phase == "g" and granted == 0:
                granted = m.start
        if m is not None and m.phase == "g" and (granted == 0 or granted != m.start):
            m = None
        if m is None:
            if self._used(ticket) and granted == 0 and not lost:
                self._release_heads(batch)
                return self._finish(Code.DUPLICATE, 0)
            if any(c > r.limit for c, r in zip(self.call.costs, self.rates)):
                return self._finish(Code.TOO_COSTLY, 0)
            return self._fresh(True, 0, 0, holder, eid, message, task, expires, max_wait, batch, lost_by,
                               granted != 0 or lost)
        waited, phase, units = self.now - m.enqueued, m.phase, self._units_of(m)
        costly = any(u > r.limit for u, r in zip(units, self.rates))
        if costly or (max_wait > 0 and waited > max_wait):
            self._come_in(ticket, m)
            if in_line:
                self._leave(ticket, m)
            self._ungrant(m)
            self.slots.pop(ticket, None)
            self._forget(ticket)
            self._release_heads(batch)
            return self._finish(Code.TOO_COSTLY if costly else Code.WAITED, 0, {"waited": waited})
        if phase != "g" and stale_ok == "1" and m.controls is not None and m.controls != self._controls_seen():
            own_slot = ticket in self.slots or holder in self.slots
            x = None
            if self.not_before == 0 and (own_slot or self._slot_free()):
                x = self._earliest(self.now, units, self._out_per_rate(units))
            if x is None or x - self.now > early:
                self.dirty = set()
                self.windows = snapshot
                self.rates = [snapshot[name] for name in self.call.fields]
                return self._finish(Code.STALE, 0, {"waited": waited})
        p = self.policy
        if in_line:
            self._leave(ticket, m)
        if phase == "g":
            self._ungrant(m)
        elif m.released > 0 and not in_line:
            trip = self.now - m.released
            if trip <= p.learn_outlier_ms * 1000:
                sample = max(0, min(trip, math.floor(self.shortest / p.learnt_cap_parts)))
                if self.delay is None or self.jitter is None:
                    self.delay, self.jitter = sample, math.floor(sample / 2)
                else:
                    err = sample - self.delay
                    self.delay += math.floor(err / p.delay_gain_parts)
                    self.jitter += math.floor((abs(err) - self.jitter) / p.jitter_gain_parts)
        beside = self._out_per_rate(units if phase != "g" and not in_line else None)
        held = ticket in self.slots or holder in self.slots
        x = None
        if self.not_before == 0 and (held or self._slot_free()):
            x = self._earliest(self.now, units, beside)
        if x is not None and x - self.now <= early:
            latest = x + (self.call.slack if x == self.now else p.grant_slacks * self.call.slack)
            self._come_in(ticket, m)
            self._record(x, latest, units)
            self._use(ticket, holder)
            held_now = self._hold(holder, x + self.call.slot_lease, ticket)
            if x == self.now:
                self._forget(ticket)
            else:
                self._write_back()
                m.phase, m.start, m.latest, m.epoch = "g", x, latest, self.epoch or 0
                self.meta[ticket] = m
                self.out[ticket] = latest + p.grant_keep_ms * 1000
                self.out_count += 1
            self._release_heads(batch)
            return self._finish(Code.RUN if x == self.now else Code.RUN_AT, x - self.now,
                                {"start": x, "latest": latest, "waited": waited, "held": held_now})
        kept = ticket in self.messages
        if not kept and message == b"":
            # (the script writes no window back: they stay as they were stored)
            self.dirty = set()
            self.windows = snapshot
            self.rates = [snapshot[name] for name in self.call.fields]
            return self._finish(Code.DENIED, x - self.now if x is not None else 0, {"waited": waited})
        self._come_in(ticket, m)
        self.slots.pop(ticket, None)
        self.slots.pop(holder, None)
        if not kept:
            self.messages[ticket] = message
        place = m.place
        if place == 0:
            place = self._front_place()
        self._join(ticket, m, place)
        self._release_heads(batch)
        return self._finish(Code.QUEUED, self._wait_of(units), {"waited": waited})

    def _release(self, batch: int, *sent: str) -> _Reply:
        self._ack_sent(sent)
        self._expire_out(self.policy.line_batch)
        self._reclaim()
        self._release_heads(batch)
        return self._finish(Code.RUN, 0, None, True)

    def _drain(self, batch: int, *sent: str) -> _Reply:
        self._ack_sent(sent)
        self._expire_out(self.policy.line_batch)
        self._release_heads(batch, True)
        return self._finish(Code.RUN, 0, None, True)

    def _ack(self, *tickets: str) -> _Reply:
        self._ack_sent(tickets)
        return self._finish(Code.RUN, 0)

    def _ack_sent(self, tickets: Sequence[str]) -> None:
        for ticket in tickets:
            m = self.meta.get(ticket) if ticket in self.out else None
            if m is not None and m.phase == "s":
                m.phase = "o"
                self.out[ticket] = self.now + self.policy.out_lease_ms * 1000
                if ticket in self.slots:
                    self.slots[ticket] = self.now + min(self.policy.out_lease_ms, self.policy.handed_slot_ms) * 1000

    def _take_back(self, lined: str, *entries: str) -> _Reply:
        for n, eid in enumerate(entries):
            m = self.meta.get(eid)
            if n < int(lined) and eid in self.line:
                self._leave(eid, m)
                self._forget(eid)
                self.reported.append((eid, m.task if m else eid, "k"))
            elif m is not None and m.phase == "s" and eid in self.out:
                self._come_in(eid, m)
                self.slots.pop(eid, None)
                self._forget(eid)
                self.reported.append((eid, m.task, "k"))
        return self._finish(Code.RUN, 0)

    def _give_back(self, ticket: str, batch: int, handed_back: str = "0") -> _Reply:
        self._expire_out(self.policy.line_batch)
        self._reclaim()
        m = self.meta.get(ticket) if ticket in self.out else None
        if handed_back == "2":
            if self._used(ticket):
                return self._finish(Code.DUPLICATE, 0)
            if m is not None:
                self._come_in(ticket, m)
                self._ungrant(m)
                self.slots.pop(ticket, None)
                self._forget(ticket)
            self._use(ticket, "")
        elif handed_back == "1":
            if m is not None and m.phase == "s" and ticket in self.messages:
                self._come_in(ticket, m)
                self.slots.pop(ticket, None)
                self._join(ticket, m, m.place)
        elif m is not None and not (m.phase == "g" and self.now >= m.start):
            self._come_in(ticket, m)
            self._ungrant(m)
            self.slots.pop(ticket, None)
            self._forget(ticket)
        self._release_heads(batch)
        return self._finish(Code.RUN, 0)

    def _settle(self, deltas: tuple[int, ...], at: int, latest: int, epoch: str, batch: int) -> _Reply:
        self._expire_out(self.policy.line_batch)
        from_lease = at == 0
        if from_lease:
            at, latest = self.now, self.now + latest
        if from_lease or (self.epoch is not None and str(self.epoch) == str(epoch)):
            for i, (r, d) in enumerate(zip(self.rates, deltas)):
                if d != 0 and latest + r.period > self.now and not (from_lease and d < 0):
                    if d > 0:
                        r.record(at, latest, d)
                    else:
                        r.unrecord(at, latest - at, -d)
                    self.dirty.add(i)
        self._release_heads(batch)
        return self._finish(Code.RUN, 0)

    def _ended(self, holder: str, batch: int) -> _Reply:
        held = self.slots.pop(holder, None) is not None
        self._expire_out(self.policy.line_batch)
        self._reclaim()
        self._release_heads(batch)
        return self._finish(Code.RUN if held else Code.LOST, 0)

    def _renew(self, *holders: str) -> _Reply:
        for holder in holders:
            until = self.slots.get(holder)
            if until is not None and until > self.now:
                self.slots[holder] = self.now + self.call.slot_lease
            else:
                self.slots.pop(holder, None)
                self.reported.append((holder, None, "l"))
        return self._finish(Code.LOST if self.reported else Code.RUN, 0)

    def _peek(self) -> _Reply:
        x = self._earliest(max(self.now, self.not_before), self.call.costs, self._out_per_rate())
        wait = (x if x is not None else self.now + self.shortest) - self.now
        if self.waiting > 0:
            wait = max(wait, self._wait_of(list(self.call.costs)))
        code = Code.RUN if x == self.now and self.waiting == 0 else Code.DENIED
        return self._finish(code, wait, None, False, True)

    def _shadow(self, holder: str, max_wait: int) -> _Reply:
        start = max(self.now, self.not_before, self.shadow_last)
        x = self._earliest(start, self.call.costs, None)
        if x is None:
            x = start + self.shortest
        running = held = 0
        if self.call.concurrency > 0:
            self._reclaim()
            running = self._slots_held()
            if holder:
                self.slots[holder] = self.now + self.call.slot_lease
                held = 1
        wait, code = x - self.now, Code.RUN
        if max_wait > 0 and wait > max_wait:
            code = Code.TOO_FAR
        else:
            if x > self.now or (self.call.concurrency > 0 and running >= self.call.concurrency):
                code = Code.DENIED
            if self.rates:
                self._record(x, x + self.call.slack, self.call.costs)
                self.shadow_last = x
        counts = self.shadow_counts
        counts["n"] += 1
        if code != Code.RUN:
            counts["h"] += 1
            counts["w"] += wait
            counts["m"] = max(counts["m"], wait)
        reply = self._finish(code, wait, {"start": x, "latest": x + self.call.slack, "held": held})
        reply.running = running
        return reply
