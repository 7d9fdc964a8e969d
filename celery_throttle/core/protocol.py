"""The protocol between the plugin and its store, and what a task carries: pure data, no
Redis.

- :class:`Code`: what the window script decided (its reply's first field; the script gets
  each code by name, :func:`.store.window_script`).
- :class:`WindowCall` (what the script is told about one call), :class:`Entry` (a task
  that may join the line), :func:`window_argv` (the ARGV of one operation) and
  :class:`WindowReply` (what it answered, with the tasks it released or reported).
- :class:`Counted`: where a call that started is counted (what a settle adjusts).
- The ``celery_throttle`` message header (:data:`HEADER`, :class:`Header`), versioned by
  :data:`HEADER_VERSION`: CHANGELOG.md records each change of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import Any, NamedTuple

from .rates import Rate

__all__ = [
    "ALGORITHM_TAGS",
    "CONTROL_STAMP",
    "DEAD_LETTER_HEADERS",
    "FOREVER_US",
    "HEADER",
    "HEADER_VERSION",
    "NO_ENTRY",
    "STATE_FORMAT",
    "STATE_LAYOUT",
    "Code",
    "Cost",
    "Counted",
    "Entry",
    "Header",
    "Reported",
    "StateLayout",
    "WindowCall",
    "WindowReply",
    "cost_arg",
    "one_cost",
    "per_rate",
    "rate_field",
    "rate_of_field",
    "window_argv",
    "without_dead_letter_headers",
]


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


#: The layout of a window state hash (window.lua's field 'f'; absent: written before the
#: field, format 1). A hash of another format (a later version's, and the deploy rolled
#: back) is started afresh, as if it had expired: what it counted is forgotten (at most
#: one window's starts counted twice over). CHANGELOG.md records each format.
STATE_FORMAT = 1


@dataclass(frozen=True)
class StateLayout:
    """How a rate's state is laid out in its field of the hash: part of the state's format
    (sliding.lua and fixed.lua are loaded with it, and the reference model built with it;
    the tests load both with another, tests/test_model_check.py)."""

    #: Buckets per window of a sliding rate: a bucket spans 1/BUCKETS of it (at least 1 ms).
    buckets: int = 100
    #: Buckets a sliding rate keeps at most; past it the front is folded even if it could
    #: still decide something (safe, a little late: only a sparse schedule, of a rate that
    #: another rate holds back, reaches it; a saturated one spans about BUCKETS buckets).
    max_buckets: int = 200
    #: Windows after the current one a fixed rate keeps before folding the older ones...
    max_ahead: int = 8
    #: ... and how many of the last of them stay as they are.
    keep_ahead: int = 4

    def values(self) -> dict[str, int]:
        """The constants the algorithm scripts read, by their names there."""
        return {"BUCKETS": self.buckets, "MAX_BUCKETS": self.max_buckets, "MAX_AHEAD": self.max_ahead,
                "KEEP_AHEAD": self.keep_ahead}


STATE_LAYOUT = StateLayout()

# -- the control hash (controls.py reads it, store.py and pause.lua write it) ----------

#: The end of a pause with no end: the largest integer a Lua number holds exactly.
FOREVER_US = 2**53 - 1
#: The field every write of the control hash adds one to (not a control: ignored by each
#: version's reader).
CONTROL_STAMP = "~stamp"


class Code(IntEnum):
    """What window.lua decided (its reply's first field; the script knows each by name)."""

    #: The call's cost is above the limit of one of its rates (nothing else is set).
    TOO_COSTLY = -1
    #: Not now, and it does not wait in the line: no message was given (call again with
    #: it), or none could be kept. ``wait``: an estimate of when it would start.
    DENIED = 0
    #: Start now.
    RUN = 1
    #: Its wait in the line would pass its max wait: it does not wait (``wait``: how long).
    TOO_FAR = 3
    #: A released task that came a little before its start (at most the caller's
    #: ``early``): the start is the caller's, to run at when ``wait`` has passed.
    RUN_AT = 5
    #: It waits in its key's line (its message kept); ``wait``: an estimate.
    QUEUED = 6
    #: At publish: it may go now, released with its entry id as ticket (send it with it).
    RELEASED = 7
    #: A released task that waited in the line longer than its max wait: it does not run.
    WAITED = 8
    #: A holder's slot lease had run out (ended, renew).
    LOST = 9
    #: A copy of a task that started lately (its ticket, or the entry it names, was used):
    #: it does not run again.
    DUPLICATE = 10
    #: A released task claimed under other controls than it was released under (a pause,
    #: a limit, a K), which would send it back to its place: nothing was done; the caller
    #: reads the controls (a resume or a raise it had not read yet) and claims again.
    STALE = 11


@dataclass(frozen=True)
class Counted:
    """Where a call that started is counted: ``units`` in the span ``[start_us,
    latest_us]`` of the window state of ``epoch`` (what settling its real cost adjusts).
    ``start_us`` 0: admitted from a lease, its own span unknown (see Checker.counted)."""

    start_us: int
    latest_us: int
    units: Cost
    epoch: int


@dataclass(frozen=True)
class WindowCall:
    """What window.lua is told about one call, whatever the operation (times in µs)."""

    algorithm: str
    rates: tuple[Rate, ...]
    #: Units the call counts: of every rate, or one count per rate (:data:`Cost`).
    cost: Cost = 1
    #: The state's field per rate, when not the rate's own name (a live limit).
    fields: tuple[str, ...] | None = None
    #: How long after the check the body may start and still count as starting then.
    slack_us: int = 0
    #: Paused until then (Redis clock; 0: not paused): nothing starts before it.
    not_before_us: int = 0
    #: At most this many bodies hold a slot at once (0: no concurrency limit).
    concurrency: int = 0
    #: A running body's slot lease.
    slot_lease_us: int = 0
    #: How long before its start a task is released while nothing is learnt of the key.
    lead_us: int = 0

    def head(self, now: str, op: str, cost: Cost | None = None) -> list[int | str]:
        """ARGV[1..] of window.lua up to the operation's own arguments."""
        return [now, op, cost_arg(self.cost if cost is None else cost), *_head_tail(self)]


@lru_cache(maxsize=4096)
def _head_tail(call: WindowCall) -> tuple[int | str, ...]:
    """ARGV[4..] of a call up to the operation's own arguments (made once per call shape)."""
    return (call.slack_us, call.not_before_us, call.concurrency, call.slot_lease_us, call.lead_us,
            *_rate_args(call.algorithm, call.rates, call.fields))


@dataclass(frozen=True)
class Entry:
    """A task as it joins a line: its entry id (random, unknown to the broker until it is
    released: its ticket then), its message (``b""``: not given; the script answers
    ``DENIED`` where it would wait), task id, ``expires`` (µs, Redis clock; 0: none),
    ``max_wait`` (µs; 0: none), and how many heads the call may release on its way."""

    id: str
    message: bytes = b""
    task_id: str = ""
    expires_us: int = 0
    max_wait_us: int = 0
    batch: int = 0

    def args(self) -> list[int | str | bytes]:
        return [self.id, self.message, self.task_id, self.expires_us, self.max_wait_us, self.batch]


#: An entry for an operation that keeps none (a direct acquire: it does not wait).
NO_ENTRY = Entry("")


class Reported(NamedTuple):
    """A task the script released or reports: ``kind`` ``"r"`` released (``payload``: its
    message, to send with ``id`` as its ticket), ``"x"`` expired while it waited or ``"c"``
    costing more than a limit now in force (its message, sent as it is: its worker
    discards or fails it), ``"l"`` its message is gone, ``"f"`` released and never
    arrived (``payload``: its task id), or a holder whose slot lease ran out (renew)."""

    id: str
    payload: bytes | str | None
    kind: str


class WindowReply(NamedTuple):
    """What window.lua answered (times in microseconds of the Redis clock).

    A named tuple: one is built per check, and a frozen dataclass took several times as
    long to build.
    """

    code: int
    wait_us: int
    #: Units still free now over the tightest rate, beside what is released and not started.
    remaining: int
    clear_at_us: int
    now_us: int
    epoch: int
    #: How early a task of this key is released before its start (learnt, or the default).
    lead_us: int = -1
    #: Units granted as a lease, this call's own included (0 if none); for an admit that
    #: fits: the units the key may take before a rate is half full.
    leased: int = 0
    #: For an admit of a call whose rates count different units, that fits: the room left
    #: in each rate (in the rates' order) before it is half full.
    rooms: tuple[int, ...] = ()
    #: Where a call that starts is counted: [start, latest] (a start granted: its start).
    start_us: int = 0
    latest_us: int = 0
    #: Tasks in the key's line, released and not started, and slots held, after the call.
    waiting: int = 0
    out: int = 0
    running: int = 0
    #: When the key next needs a look (0: nothing waits), and whether the caller must tell
    #: the index so (1: if earlier than it holds, 2: whatever it holds).
    due_us: int = 0
    tell_index: int = 0
    #: How long a released task waited in the line (a claim).
    waited_us: int = 0
    #: 1 if the call's holder holds a concurrency slot after it (a body that starts).
    held: int = 0
    #: Tasks released or reported on the way.
    reported: tuple[Reported, ...] = ()

    @property
    def allowed(self) -> bool:
        return self.code == Code.RUN

    @classmethod
    def of(cls, raw: Sequence[Any]) -> WindowReply:
        """The reply from the script's array."""
        rooms = raw[8]
        rooms = tuple(int(v) for v in rooms.split(b",")) if isinstance(rooms, bytes) and rooms else ()
        reported = tuple(Reported(_decoded(raw[i]), _payload(raw[i + 1], raw[i + 2]), _decoded(raw[i + 2]))
                         for i in range(18, len(raw) - 2, 3))
        return cls(raw[0], raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7], rooms, raw[9], raw[10], raw[11],
                   raw[12], raw[13], raw[14], raw[15], raw[16], raw[17], reported)


def _decoded(value: bytes | str) -> str:
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else value


def _payload(value: Any, kind: bytes | str) -> bytes | str | None:
    if value is None:
        return None
    return value if _decoded(kind) in ("r", "x", "c") else _decoded(value)


def window_argv(now: str, op: str, call: WindowCall, *args: Any, cost: Cost | None = None) -> list[Any]:
    """ARGV of window.lua for ``op`` on ``call``: its head, then the operation's own
    arguments as line.lua lists them (``tests/test_script_format.py`` holds the two
    together). ``cost``: a settle's difference, in place of the call's cost."""
    return [*call.head(now, op, cost), *args]


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
#: Message header of a task the throttle let go after it waited: its ticket, and counters.
HEADER = "celery_throttle"
#: The header's format as this version writes it. Format 3 carries a ticket (``t``): the
#: entry id of the line it was released from, which grants it nothing by itself (the
#: store must hold it out, unused). Formats 1 and 2 carried a start reserved for it
#: (``r``), which is not honoured any more: such a task is checked as a fresh one (it runs
#: once; the start it held stays counted until it leaves its window). A header of a later
#: format (a deploy rolled back while such messages wait) is read as absent: a fresh call.
#: CHANGELOG.md records each format.
HEADER_VERSION = 3
#: The most deferrals and store errors in a row a header counts (a counter that reads
#: more, written by hand, counts this many).
_COUNTER_MAX = 1 << 20


@dataclass(frozen=True)
class Header:
    """The ``celery_throttle`` header: ``key``, the state key of the line the task was
    released from, and ``ticket``, its entry there (both "" for none); ``deferrals``, how
    many times it was turned away (observability); ``errors``, store errors in a row (its
    back-off); ``pending``, the entry it may hold in the line of ``key`` already (a call
    that put it there, whose reply was lost: the store went away mid-call), so that it is
    not let in twice. Every field is read from whatever a message holds: anything that is
    not what this version writes counts as absent, field by field, and never raises.
    Nothing in it grants anything by itself: a ticket is one the store holds out, and a
    pending entry one it holds waiting."""

    key: str = ""
    ticket: str = ""
    deferrals: int = 0
    errors: int = 0
    pending: str = ""

    @classmethod
    def read(cls, value: Any) -> Header:
        if not isinstance(value, dict):
            return _EMPTY
        version = value.get("v", 1)
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= HEADER_VERSION:
            return _EMPTY
        key = value.get("k")
        ticket, pending = (value.get("t"), value.get("i")) if version >= 3 else (None, None)
        return cls(_text(key), _text(ticket), _counter(value.get("n")), _counter(value.get("e")), _text(pending))

    def value(self) -> dict[str, Any]:
        """The header to send."""
        out: dict[str, Any] = {"v": HEADER_VERSION, "n": self.deferrals}
        if self.key:
            out["k"] = self.key
        if self.ticket:
            out["t"] = self.ticket
        if self.errors:
            out["e"] = self.errors
        if self.pending:
            out["i"] = self.pending
        return out


_EMPTY = Header()
#: The longest key or ticket a header is read with (a state key is bounded: keys.MAX_TOKEN).
_TEXT_MAX = 1024


def _text(value: Any) -> str:
    return value if isinstance(value, str) and len(value) <= _TEXT_MAX else ""


def _counter(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return min(value, _COUNTER_MAX)
    return 0


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
