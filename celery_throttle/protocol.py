"""The protocol between the plugin and its store, and what a task carries: pure data, no
Redis.

- :class:`Code`: what a window script decided (its reply's first field; the scripts get
  each code by name, :func:`.store.window_script`).
- :class:`WindowCall` (what a script is told about one call), :func:`window_argv` (its
  ARGV) and :class:`WindowReply` (what it answered).
- :class:`Reservation`: a start reserved for a denied call, as a claim and a header carry it.
- The ``celery_throttle`` message header (:data:`HEADER`, :func:`read_state`), versioned
  by :data:`HEADER_VERSION`: CHANGELOG.md records each change of it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property, lru_cache
from typing import Any, NamedTuple

from .rates import Rate

__all__ = ["ALGORITHM_TAGS", "DEAD_LETTER_HEADERS", "HEADER", "HEADER_VERSION", "STATE_FORMAT", "STATE_LAYOUT", "Code", "Cost", "Counted", "Reservation", "SlotCode", "SlotReply",
           "StateLayout", "WindowCall", "WindowReply", "cost_arg", "header_value", "one_cost", "per_rate", "rate_field", "rate_of_field", "rates_tag", "read_state", "window_argv", "window_argv_settle",
           "without_dead_letter_headers"]


#: What a call costs: units of every one of its rates (an int), or one count per rate, in
#: the rates' order (a tuple), when its rates count different units (``"500/m"`` and
#: ``"30000 tokens/m"``).
Cost = int | tuple[int, ...]


def cost_arg(cost: Cost) -> int | str:
    """A cost as the window script reads it: a number, or a count per rate, comma-separated."""
    return cost if isinstance(cost, int) else ",".join(map(str, cost))


def per_rate(cost: Cost, rates: int) -> tuple[int, ...]:
    """``cost`` as a count for each of ``rates`` rates (a count per rate of another number
    of rates is a ValueError: it would not line up with them)."""
    if isinstance(cost, int):
        return (cost,) * rates
    if len(cost) != rates:
        raise ValueError(f"{rates} rates, but a count for {len(cost)}: {cost}")
    return tuple(cost)


def one_cost(counts: Sequence[int]) -> Cost:
    """A count per rate as a :data:`Cost`: one number when it is the same for every rate."""
    return counts[0] if counts and all(c == counts[0] for c in counts) else tuple(counts)


def _header_cost(value: Any) -> bool:
    """Whether ``value`` is a cost as a header carries it: an int, or a list of them."""
    if isinstance(value, list):
        return len(value) >= 2 and all(_header_int(v) and v > 0 for v in value)
    return _header_int(value) and value > 0


def _header_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53


@dataclass(frozen=True)
class Reservation:
    """A start reserved for a denied call: it may start in ``[start_us, latest_us]``.

    ``epoch`` names the window state it was made in; a reset or lost state voids it.
    ``lead_us``: how long before ``start_us`` the task was due to arrive.
    ``rates_tag``: which rates it was reserved under (:func:`rates_tag`; 0: unknown). A
    claim under other rates (a live limit set since) gives it back and is checked afresh.
    """

    start_us: int
    latest_us: int
    cost: Cost
    grace_us: int
    epoch: int
    lead_us: int = 0
    rates_tag: int = 0

    def to_header(self) -> list[Any]:
        cost = self.cost if isinstance(self.cost, int) else list(self.cost)
        return [self.start_us, self.latest_us, cost, self.grace_us, self.epoch, self.lead_us, self.rates_tag]

    def script_args(self) -> list[int | str]:
        """ARGV[7..12] of window.lua for a claim of it."""
        return [self.start_us, self.latest_us, cost_arg(self.cost), self.grace_us, self.epoch, self.lead_us]

    @classmethod
    def from_header(cls, value: Any) -> Reservation | None:
        """The reservation a header holds, or None for anything else (6 fields: written
        before rates were tagged; a cost that is a list: one per rate, header format 2)."""
        if not isinstance(value, (list, tuple)) or len(value) not in (6, 7):
            return None
        if not (_header_cost(value[2]) and all(_header_int(v) for i, v in enumerate(value) if i != 2)):
            return None
        cost = value[2] if isinstance(value[2], int) else tuple(value[2])
        return cls(value[0], value[1], cost, *value[3:])


@lru_cache(maxsize=1024)
def rates_tag(rates: tuple[Rate, ...]) -> int:
    """A short name of a set of rates, carried by the reservations made under it."""
    return zlib.crc32(",".join(map(str, rates)).encode()) or 1


#: The layout of a window state hash (window.lua's field 'f'; absent: written before the
#: field, format 1). A hash of another format (a later version's, and the deploy rolled
#: back) is started afresh, as if it had expired: its reservations are checked afresh
#: and what it counted is forgotten (at most one window's starts counted twice over).
#: CHANGELOG.md records each format.
STATE_FORMAT = 1


@dataclass(frozen=True)
class StateLayout:
    """How a rate's state is laid out in its field of the hash: part of the state's format
    (sliding.lua and fixed.lua are loaded with it, and the reference model built with it;
    the tests load both with another, tests/test_model_check.py)."""

    #: Buckets per window of a sliding rate: a bucket spans 1/SLOTS of it (at least 1 ms).
    slots: int = 100
    #: Buckets a sliding rate keeps at most; past it the front is folded even if it could
    #: still decide something (safe, a little late: only a sparse schedule, of a rate that
    #: another rate holds back, reaches it; a saturated one spans about SLOTS buckets).
    max_buckets: int = 200
    #: Windows after the current one a fixed rate keeps before folding the older ones...
    max_ahead: int = 8
    #: ... and how many of the last of them stay as they are.
    keep_ahead: int = 4

    def values(self) -> dict[str, int]:
        """The constants the algorithm scripts read, by their names there."""
        return {"SLOTS": self.slots, "MAX_BUCKETS": self.max_buckets, "MAX_AHEAD": self.max_ahead,
                "KEEP_AHEAD": self.keep_ahead}


STATE_LAYOUT = StateLayout()


class Code(IntEnum):
    """What window.lua decided (its reply's first field; the script knows each by name)."""

    #: The call's cost is above the limit of one of its rates (nothing else is set).
    TOO_COSTLY = -1
    #: Not now, and no start reserved (none asked for, a pause too long to reserve
    #: behind, or none settled): ``wait`` is when to check again.
    DENIED = 0
    #: Start now.
    RUN = 1
    #: A claim that came before its reserved start (``wait`` until it).
    EARLY = 2
    #: The earliest start is further than the caller's max wait: nothing reserved.
    TOO_FAR = 3
    #: Not now, and a start was reserved for it: ``start``, ``latest`` and ``grace``
    #: say which, ``wait`` until it.
    RESERVED = 4
    #: A claim that came a little before its reserved start (at most the caller's
    #: ``early``): the start is the caller's, to run at when ``wait`` has passed.
    RUN_AT = 5


@dataclass(frozen=True)
class Counted:
    """Where a call that started is counted: ``units`` in the span ``[start_us,
    latest_us]`` of the window state of ``epoch`` (what settling its real cost adjusts).
    ``start_us`` 0: admitted from a lease, its own span unknown (see Checker.counted)."""

    start_us: int
    latest_us: int
    units: Cost
    epoch: int

    def script_args(self, delta: Cost) -> list[int | str]:
        """ARGV[7..12] of window.lua for a settle of ``delta`` units (a count per rate, for
        rates of different units)."""
        return [self.start_us, self.latest_us, cost_arg(delta), 0, self.epoch, 0]


class SlotCode(IntEnum):
    """What slots.lua answered (its reply's first field; the script knows each by name)."""

    #: A holder's lease had run out (release, renew): another task may have had its slot.
    LOST = 0
    #: The slot is the holder's (take), or was (release); the call did what it was asked.
    TAKEN = 1
    #: No slot free, and the task was not queued (no message was given).
    FULL = 2
    #: No slot free: the task is queued, its message kept, until a slot is handed to it.
    QUEUED = 3
    #: At publish (enqueue): a slot is free and nobody waits; send the task.
    FREE = 4


@dataclass(frozen=True)
class SlotReply:
    """slots.lua's reply: the code, slots held and tasks queued after the call, the
    Redis clock, and the tasks a slot was handed to, each with its message (None: lost)."""

    code: SlotCode
    running: int
    waiting: int
    now_us: int
    woken: tuple[tuple[str, bytes | None], ...] = ()
    #: For a renewal: the holders whose lease had run out.
    lost: tuple[str, ...] = ()


@dataclass(frozen=True)
class WindowCall:
    """What window.lua is told about one call, whatever the operation (times in µs)."""

    algorithm: str
    rates: tuple[Rate, ...]
    #: Units the call counts: of every rate, or one count per rate (:data:`Cost`).
    cost: Cost = 1
    #: The state's field per rate, when not the rate's own name (a live limit).
    fields: tuple[str, ...] | None = None
    #: How long after its reserved start a call may still use it.
    grace_us: int = 0
    #: How long after the check the body may start and still count as starting then.
    slack_us: int = 0
    #: A start further away than this is not reserved (``Code.TOO_FAR``; 0: no cap).
    max_wait_us: int = 0
    #: Paused until then (Redis clock; 0: not paused): nothing starts before it.
    not_before_us: int = 0
    #: A pause ending further away than this reserves nothing: the reply is a denial
    #: without a start whose wait is this horizon (0: no pause is that long).
    pause_horizon_us: int = 0

    @cached_property
    def argv_tails(self) -> dict[tuple[Any, ...], tuple[int | str, ...]]:
        """ARGV[2..] of window.lua for a call without a claim, by (op, reserve, learn,
        lease, lease span): :func:`window_argv` builds each once per WindowCall, which
        ``Throttle`` keeps per call shape. (Not a field: no part of equality or hash.)"""
        return {}


class WindowReply(NamedTuple):
    """What window.lua answered (times in microseconds of the Redis clock).

    A named tuple: one is built per check, and a frozen dataclass took several times as
    long to build.
    """

    code: int
    wait_us: int
    remaining: int
    clear_at_us: int
    start_us: int
    latest_us: int
    now_us: int
    epoch: int
    #: The learnt dispatch delay of this key (-1: nothing learnt yet).
    lead_us: int
    #: The grace given to the start reserved by this call (0 if none).
    grace_us: int
    #: Units granted as a lease, this call's own included (0 if none).
    leased: int = 0
    #: For an 'admit' of a call whose rates count different units, that fits: the room
    #: left in each rate (in the rates' order) before it is half full.
    rooms: tuple[int, ...] | list[int] = ()

    @property
    def allowed(self) -> bool:
        return self.code == Code.RUN


def window_argv(now: str, op: str, call: WindowCall, *, reserve: bool = False,
                claim: Reservation | None = None, learn: str = "1", lease: int = 0,
                lease_span_us: int = 0, early_us: int = 0) -> list[int | str]:
    """ARGV of window.lua, in the order its header documents (``tests/test_script_format.py``
    holds the two together). ``early_us``: for a claim, how early it may come and still be
    granted its start (``Code.RUN_AT``)."""
    if claim is None:
        shape = (op, reserve, learn, lease, lease_span_us)
        tail = call.argv_tails.get(shape)
        if tail is None:
            tail = call.argv_tails[shape] = tuple(_window_argv(op, call, reserve, _NO_CLAIM, learn, lease,
                                                               lease_span_us, 0))
        return [now, *tail]
    return [now, *_window_argv(op, call, reserve, claim.script_args(), learn, lease, lease_span_us, early_us)]


def _window_argv(op: str, call: WindowCall, reserve: bool, claim_args: Sequence[int | str], learn: str,
                 lease: int, lease_span_us: int, early_us: int) -> list[int | str]:
    """ARGV[2..] of window.lua."""
    args: list[int | str] = [op, "1" if reserve else "0", cost_arg(call.cost), call.grace_us, call.slack_us]
    args += claim_args
    args += [learn, lease, lease_span_us, call.max_wait_us, call.not_before_us,
             call.pause_horizon_us or _FOREVER_HORIZON, early_us]
    args += _rate_args(call.algorithm, call.rates, call.fields)
    return args


def window_argv_settle(now: str, call: WindowCall, counted: Counted, delta: Cost) -> list[int | str]:
    """ARGV of window.lua for a settle: its cost (ARGV[4]) is not checked, the units it
    reports are ``delta``."""
    return [now, *_window_argv("settle", call, False, counted.script_args(delta), "0", 0, 0, 0)]


_NO_CLAIM = (0, 0, 0, 0, "", 0)
_FOREVER_HORIZON = 2**53

#: The first letter of a rate's field in the state hash: "s25/1000000" holds sliding
#: "25/s". ``Throttle.status`` reads the rates a hash holds back from these names.
ALGORITHM_TAGS = {"sliding": "s", "fixed": "f"}


def rate_field(algorithm: str, rate: Rate) -> str:
    """The state hash's field of ``rate``: "s25/1000000" holds sliding "25/s", and
    "s30000/60000000.tokens" sliding "30000 tokens/m"."""
    unit = f".{rate.unit}" if rate.unit else ""
    return f"{ALGORITHM_TAGS[algorithm]}{rate.limit}/{rate.period_us}{unit}"


def rate_of_field(field: str) -> tuple[str, int, int, str] | None:
    """(algorithm, limit, period in µs, unit) of a field :func:`rate_field` named, or None
    for any other field."""
    algorithm = _ALGORITHM_OF_TAG.get(field[:1])
    limit, _, rest = field[1:].partition("/")
    period_us, _, unit = rest.partition(".")
    if algorithm is None or not (limit.isdigit() and period_us.isdigit()) or (unit and not unit.isidentifier()):
        return None
    return algorithm, int(limit), int(period_us), unit


_ALGORITHM_OF_TAG = {tag: algorithm for algorithm, tag in ALGORITHM_TAGS.items()}


@lru_cache(maxsize=1024)
def _rate_args(algorithm: str, rates: tuple[Rate, ...], fields: tuple[str, ...] | None = None,
               ) -> tuple[int | str, ...]:
    args: list[int | str] = [len(rates)]
    for i, rate in enumerate(rates):
        args += [rate.limit, rate.period_us, fields[i] if fields else rate_field(algorithm, rate)]
    return tuple(args)


# -- the message header --------------------------------------------------------------
#: Message header carrying a deferred task's reservation and counters:
#: ``k`` the state key it was reserved under, ``r`` the reservation
#: (:meth:`Reservation.to_header`), ``n`` deferrals so far, ``e`` store errors in a row,
#: ``p`` 1 if a pause held it (it was parked, for a resume to send it at once), ``w``
#: since when it waits for a concurrency slot (µs, the host's clock), ``v`` the format's
#: version (:data:`HEADER_VERSION`).
HEADER = "celery_throttle"
#: The header's format as this version writes it. A header without ``v`` was written
#: before the field existed, in format 1. One from a later format (a deploy rolled back
#: while such messages wait) is read as absent: the task is checked afresh, which may
#: count it twice in its window but never lets it run unchecked. CHANGELOG.md records
#: each format. A header is written in the oldest format that holds it (2 only for a
#: reservation with a cost per rate), so a deploy rolled back still reads the others.
HEADER_VERSION = 2


#: Headers RabbitMQ adds to a message it dead-letters, as the delay topology of broker
#: parking does at each hop (the names Celery's own retry() drops, X_DEATH_HEADERS). A
#: re-send that kept them would pass the same delay queue a second time with them, which
#: RabbitMQ takes for a dead-letter cycle and drops the message, without a word.
DEAD_LETTER_HEADERS = frozenset({"x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
                                 "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason"})


def without_dead_letter_headers(headers: Any) -> dict[str, Any]:
    """A copy of a message's headers without DEAD_LETTER_HEADERS."""
    if not isinstance(headers, dict):
        return {}
    return {name: value for name, value in headers.items() if name not in DEAD_LETTER_HEADERS}


def read_state(value: Any) -> dict[str, Any]:
    """The header of a message as this version wrote it, from whatever it holds.

    A message may come from a foreign producer, an older version or a hand: anything
    that is not what we write counts as absent (a fresh call), field by field, and
    never raises.
    """
    if not isinstance(value, dict):
        return {}
    version = value.get("v", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version > HEADER_VERSION:
        return {}
    state: dict[str, Any] = {}
    if isinstance(value.get("k"), str):
        state["k"] = value["k"]
    reservation = Reservation.from_header(value.get("r"))
    if reservation is not None:
        state["r"] = reservation.to_header()
    for counter in ("n", "e", "p"):
        number = value.get(counter)
        if isinstance(number, int) and not isinstance(number, bool) and 0 <= number < 2**31:
            state[counter] = number
    if _header_int(value.get("w")):  # (since when it waits for a slot, µs)
        state["w"] = value["w"]
    return state


def header_value(state: dict[str, Any]) -> dict[str, Any]:
    """The header to send for ``state`` (as :func:`read_state` returns it, updated)."""
    reservation = state.get("r")
    per_rate = isinstance(reservation, list) and len(reservation) > 2 and isinstance(reservation[2], list)
    return {**state, "v": 2 if per_rate else 1}
