"""A fair share of a scope's slots: ``@throttle(concurrency=K, key=..., share=...)`` lets at
most K bodies of the scope run at once, across all its keys, handed to the keys that have
work by weight, and wholly to a key that is alone.

Each key holds a cap (how many of the K its bodies may hold), checked with its slots in
window.lua; one worker at a time (the sharer, :mod:`..waits.sharer`) moves the caps to the
fair share of each key a few times a second. This module is its arithmetic, pure:

- :func:`fair_shares`: weighted max-min fairness (water-filling): each key with work gets
  K in proportion to its weight, none more than it can use (what runs and waits, and its
  ``most``); what one cannot use goes to the others by weight; what nobody can use stays
  with the keys that have work, up to their ``most`` (a key alone gets every slot, and its
  next task starts at once), or, none having work, with the idle keys.
- :func:`whole_caps`: slots are whole: each key gets the whole part of its share, and the
  slots left over go to the keys owed most (their *credit*: the share each was due less
  the slots it held, summed over the passes), so that twenty keys sharing eight slots
  take turns rather than the same eight keys holding them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from .errors import ConfigurationError
from .options import option_of

__all__ = [
    "CREDIT_MOST",
    "KEEP_S",
    "Keeping",
    "KeyUse",
    "Share",
    "check_weight",
    "fair_shares",
    "plan",
    "raises",
    "share_of",
    "whole_caps",
]

#: A key that goes idle keeps a slot for at most this long (seconds), in proportion to how
#: busy it was over about this long before, and only once it came back from idle within this
#: long (:class:`Keeping`): one task after another, each sent when the last ends, is not
#: idle, but a key that ran one short task is, and so is a tenant whose batch has ended.
KEEP_S = 1.0
#: A key's credit is kept within this many slot-passes either way: a key that waited long
#: is first in turn for a while, not for ever, and one that ran alone owes little later.
#: (Wide enough that twenty keys taking turns at eight slots never reach it: keys at the
#: bound would be ordered by name.)
CREDIT_MOST = 100.0


@dataclass(frozen=True)
class Share:
    """How a key takes part in its scope's share: its ``weight`` (a positive number, or a
    callable over the task's arguments returning one: a tenant's plan), and ``most``, the
    slots one key may hold at most (None: any of the scope's K)."""

    weight: float | Callable[..., Any] = 1
    most: int | None = None

    def __post_init__(self) -> None:
        if not callable(self.weight):
            check_weight(self.weight)
        if self.most is not None and (isinstance(self.most, bool) or not isinstance(self.most, int)
                                      or self.most < 1):
            raise ConfigurationError(f"share most must be a whole number of slots, at least 1, got {self.most!r}")


def check_weight(value: Any) -> float:
    """A weight as a positive, finite float (else a ConfigurationError saying so)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigurationError(f"a share's weight must be a positive number, got {value!r}")
    return float(value)


def share_of(value: Any) -> Share | None:
    """``share=`` as declared: True (weight 1 each), a :class:`Share`, a dict of its fields
    (rules), or None/False (each key its own K)."""
    return option_of(value, Share, "share")


class KeyUse(NamedTuple):
    """What the sharer reads of one key: its ``weight``, ``most`` (0: none), the cap it
    holds, the slots ``held`` (bodies running and tasks released to start), the tasks
    ``waiting`` in its line, and the slots ``kept`` for it (a key that had work a moment
    ago: see :data:`KEEP_S`)."""

    weight: float
    most: int
    cap: int
    held: int
    waiting: int
    kept: int = 0

    @property
    def work(self) -> int:
        """The slots the key can use: what it holds and what waits, or what is kept for it."""
        return max(self.held + self.waiting, self.kept)


class Keeping:
    """Which idle keys keep a slot, seen pass after pass. Each key's *busy*: the share of the
    last KEEP_S or so in which it held a slot (a moving average over the passes, each
    interval between two weighed by its length, half held if held at one end only). A key
    that goes idle keeps one slot for KEEP_S times its busy, once it has *come back*: had
    work again after an idle shorter than KEEP_S. A key sending its next task as its last
    ends (busy near 1) finds its slot still there from its second task on, while a key that
    ran one task of 50 ms costs the others a few ms of slot at most, not a whole KEEP_S each
    time (a stream of such keys would hold the slots idle), and a tenant whose batch, sent
    at once, has ended (never idle until then) costs them nothing: forty such beside a
    flood held the slots that their last tasks left (tests/pure/test_share.py)."""

    def __init__(self) -> None:
        #: key -> (busy, when last seen, whether it held a slot then)
        self._busy: dict[str, tuple[float, float, bool]] = {}
        #: key -> since when it has held nothing and had nothing waiting
        self._idle: dict[str, float] = {}
        #: the keys that came back: had work again after an idle shorter than KEEP_S
        self._back: set[str] = set()

    def kept(self, key: str, now: float, held: int, waiting: int) -> int:
        """The slots kept for ``key`` (0 or 1), seen at ``now`` (seconds, monotonic)."""
        busy, seen, was = self._busy.get(key, (0.0, now, False))
        decay = math.exp(-max(now - seen, 0.0) / KEEP_S)
        busy = busy * decay + (1.0 - decay) * (was + (held > 0)) / 2  # (held at neither end, one, both)
        self._busy[key] = (busy, now, held > 0)
        if held or waiting:
            since = self._idle.pop(key, None)
            if since is not None and now - since < KEEP_S:
                self._back.add(key)
            return 0
        since = self._idle.setdefault(key, now)
        if now - since >= KEEP_S:
            self._back.discard(key)  # (not one task after another: it comes back to no kept slot)
            return 0
        return int(key in self._back and now - since < KEEP_S * busy)

    def idle_for(self, key: str, now: float) -> float:
        """How long ``key`` has had nothing held nor waiting (0: it has work, or unseen)."""
        return now - self._idle.get(key, now)

    def forget(self, key: str) -> None:
        self._busy.pop(key, None)
        self._idle.pop(key, None)
        self._back.discard(key)


def _fill(budget: float, room: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Water-filling: ``budget`` split by weight, none more than its ``room``."""
    given = dict.fromkeys(room, 0.0)
    open_ = {k for k, r in room.items() if r > 0}
    while budget > 1e-9 and open_:
        level = budget / sum(weights[k] for k in open_)
        full = {k for k in open_ if room[k] - given[k] <= level * weights[k]}
        if not full:
            for k in open_:
                given[k] += level * weights[k]
            break
        for k in full:
            budget -= room[k] - given[k]
            given[k] = room[k]
        open_ -= full
    return given


def fair_shares(total: int, keys: Mapping[str, KeyUse]) -> tuple[dict[str, float], dict[str, float]]:
    """Each key's due and share of ``total`` slots (real numbers). Its due: its part, by
    weight, among the keys with work, none more than it can use (what it holds and what
    waits, at most its ``most``). Its share: its due, and what nobody is due, to the keys
    with work up to their ``most``, else (none has work) to the idle keys: kept for them,
    so that a key's next task starts at once while no other key needs the slot."""
    limit = {k: float(min(u.most or total, total)) for k, u in keys.items()}
    weights = {k: u.weight for k, u in keys.items()}
    busy = {k: min(float(u.work), limit[k]) for k, u in keys.items() if u.work > 0}
    due = _fill(float(total), busy, weights)
    left = float(total) - sum(due.values())
    extra = _fill(left, {k: limit[k] - due[k] for k in busy}, weights)
    left -= sum(extra.values())
    spare = _fill(left, {k: limit[k] for k in keys if k not in busy}, weights)
    shares = {k: due.get(k, 0.0) + extra.get(k, 0.0) + spare.get(k, 0.0) for k in keys}
    return {k: due.get(k, 0.0) for k in keys}, shares


def whole_caps(total: int, shares: Mapping[str, float], credit: Mapping[str, float]) -> dict[str, int]:
    """Whole caps from ``shares`` (summing to ``total`` at most): the whole part of each, and
    one more for each slot left, to the keys with a part left, the most ``credit`` (plus
    that part) first; ties by name, so a pass is reproducible."""
    caps = {k: math.floor(s + 1e-9) for k, s in shares.items()}
    left = total - sum(caps.values())
    owed = sorted((k for k, s in shares.items() if s - caps[k] > 1e-9),
                  key=lambda k: (-(credit.get(k, 0.0) + shares[k] - caps[k]), k))
    for k in owed[:max(left, 0)]:
        caps[k] += 1
    return caps


def plan(total: int, uses: Mapping[str, KeyUse], credit: dict[str, float]) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """One pass's caps for keys ``uses`` of ``total`` slots, and the lowers to write first
    (``credit`` is brought up to date: a key with no work owes and is owed nothing)."""
    due, shares = fair_shares(total, uses)
    caps = whole_caps(total, shares, credit)
    busy = [k for k, use in uses.items() if use.work]
    for k in set(credit) - set(busy):
        del credit[k]
    for k in busy:
        credit[k] = credit.get(k, 0.0) + due[k] - uses[k].held
    # (Only the order of the credits counts: kept about 0 on average, so that slots idle at
    # a pass, owed to nobody, do not lift them all to the bound and lose the order.)
    mean = sum(credit.values()) / len(credit) if credit else 0.0
    for k in busy:
        credit[k] = max(-CREDIT_MOST, min(CREDIT_MOST, credit[k] - mean))
    return caps, [(k, caps[k]) for k in uses if caps[k] < uses[k].cap]


def raises(total: int, caps: Mapping[str, int], uses: Mapping[str, KeyUse], bound: Mapping[str, int],
           credit: Mapping[str, float]) -> list[tuple[str, int]]:
    """The raises that fit once the lowers are written: ``bound``, what each key can hold
    from then on (the larger of its cap and what it held after its lower; for a key not
    lowered, of its cap and what it held when read), leaves ``total`` less its sum to
    share, to the keys owed most first."""
    free = total - sum(bound.values())
    out: list[tuple[str, int]] = []
    for k in sorted((k for k in caps if caps[k] > uses[k].cap), key=lambda k: (-credit.get(k, 0.0), k)):
        if free <= 0:
            break
        step = min(caps[k] - uses[k].cap, free)
        out.append((k, uses[k].cap + step))
        free -= step
    return out
