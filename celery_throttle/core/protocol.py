"""The protocol between the plugin and its store's window script: pure data, no Redis.

- :class:`Code`: what the window script decided (its reply's first field; the script gets
  each code by name, :func:`.store.window_script`), and :class:`Verdict`: what that means
  for a task, the one value the hook, the consumer's screen and publish act on.
- :class:`WindowCall` (what the script is told about one call), :class:`Entry` (a task
  that may join the line), :func:`window_argv` (the ARGV of one operation) and
  :class:`WindowReply` (what it answered, with the tasks it released or reported).
- :class:`Counted`: where a call that started is counted (what a settle adjusts).

What a task carries is in :mod:`.header`; the state hash's format, in :mod:`.state`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from functools import lru_cache
from typing import Any, NamedTuple

from .rates import Rate
from .state import rate_field

__all__ = [
    "NO_ENTRY",
    "REPLY_PLACES",
    "Code",
    "Cost",
    "Counted",
    "Entry",
    "Reported",
    "Verdict",
    "WindowCall",
    "WindowReply",
    "cost_arg",
    "one_cost",
    "per_rate",
    "window_argv",
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


class Verdict(Enum):
    """What a check decided for a task: the one value the pool's hook, the consumer's screen
    and publish act on (each as its place allows: the hook starts a body, the screen hands a
    message to the pool, publish sends it). From the script's :class:`Code` by
    :attr:`WindowReply.verdict`."""

    #: It may go on now (RUN): the body starts; the message goes to the pool, or is sent.
    START = "start"
    #: A released task a little early (RUN_AT): it starts at the start granted to it.
    START_AT = "start at"
    #: At publish, it fits now (RELEASED): it is sent with its entry id as its ticket.
    RELEASED = "released"
    #: It waits in its key's line, its message kept (QUEUED).
    WAITS = "waits"
    #: Not kept (DENIED): without its message, check again with it; with it, the line
    #: could not keep it.
    NOT_KEPT = "not kept"
    #: A copy of a task that started lately (DUPLICATE): it does not run again.
    COPY = "copy"
    #: It never runs as it is: its wait would pass its max wait (TOO_FAR), it waited past
    #: it (WAITED), or its cost is above a rate's limit in force (TOO_COSTLY).
    REFUSED = "refused"
    #: Released under controls this process had not read (STALE): read them, check again.
    STALE = "stale"
    #: A holder's slot lease had run out (LOST).
    LOST = "lost"


_VERDICTS = {
    Code.RUN: Verdict.START, Code.RUN_AT: Verdict.START_AT, Code.RELEASED: Verdict.RELEASED,
    Code.QUEUED: Verdict.WAITS, Code.DENIED: Verdict.NOT_KEPT, Code.DUPLICATE: Verdict.COPY,
    Code.TOO_FAR: Verdict.REFUSED, Code.WAITED: Verdict.REFUSED, Code.TOO_COSTLY: Verdict.REFUSED,
    Code.STALE: Verdict.STALE, Code.LOST: Verdict.LOST,
}


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
    #: An adaptive throttle's law, (floor, decrease, growth) (core/adapt.py): the rates are
    #: its ceiling, each in force at the share the key's last pushback leaves (None: not
    #: adaptive).
    adapt: tuple[float, float, float] | None = None
    #: The :attr:`concurrency` is the scope's, shared between its keys (core/share.py): the
    #: key holds as many slots as its cap says (sent as -K; the cap is KEYS[8]).
    shared: bool = False
    #: When the process read the controls this call was made under (its pause, limits
    #: and K; µs, Redis clock; 0: unknown): a due time the call tells the index of, if
    #: computed before the key's last wake-up, may bring its look earlier, never later.
    read_us: int = 0

    def head(self, now: str, op: str, cost: Cost | None = None) -> list[int | str]:
        """ARGV[1..] of window.lua up to the operation's own arguments."""
        return [now, op, cost_arg(self.cost if cost is None else cost), *_head_tail(self)]


@lru_cache(maxsize=4096)
def _head_tail(call: WindowCall) -> tuple[int | str, ...]:
    """ARGV[4..] of a call up to the operation's own arguments (made once per call shape)."""
    return (call.slack_us, call.not_before_us, -call.concurrency if call.shared else call.concurrency,
            call.slot_lease_us, call.lead_us, call.read_us,
            *_rate_args(call.algorithm, call.rates, call.fields, call.adapt))


@dataclass(frozen=True)
class Entry:
    """A task as it joins a line: its entry id (random, unknown to the broker until it is
    released: its ticket then), its message (``b""``: not given; the script answers
    ``DENIED`` where it would wait), task id, ``expires`` (µs, Redis clock; 0: none),
    ``max_wait`` (µs; 0: none), how many heads the call may release on its way, and
    ``lost``: the holder (a delivery) of this task's own call whose reply was lost, should
    the store have started the entry in its name (it ran nothing: checked again, not
    dropped as a copy of a task that ran); ``urgency``: its priority."""

    id: str
    message: bytes = b""
    task_id: str = ""
    expires_us: int = 0
    max_wait_us: int = 0
    batch: int = 0
    lost: str = ""
    #: Levels of priority ahead of its broker's default (negative: behind), as
    #: :func:`.priority.urgency` reads them: where it joins its line (line.lua's place_of).
    urgency: int = 0

    def args(self) -> list[int | str | bytes]:
        return [self.id, self.message, self.task_id, self.expires_us, self.max_wait_us, self.batch, self.lost,
                self.urgency]


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
    #: the index so (1: if earlier than it holds, 2: whatever it holds; always 0 on a single
    #: Redis, where the script told it itself).
    due_us: int = 0
    tell_index: int = 0
    #: How long a released task waited in the line (a claim).
    waited_us: int = 0
    #: 1 if the call's holder holds a concurrency slot after it (a body that starts).
    held: int = 0
    #: The slots the key may hold now: its concurrency limit, or its cap in its scope's
    #: share (0: none yet; the sharer has not seen it).
    slot_cap: int = 0
    #: Tasks released or reported on the way.
    reported: tuple[Reported, ...] = ()

    @property
    def allowed(self) -> bool:
        return self.code == Code.RUN

    @property
    def verdict(self) -> Verdict:
        """What the reply decided for the task (see :class:`Verdict`)."""
        return _VERDICTS[self.code]  # type: ignore[index]  # (an int from the script: a Code's hash)

    @classmethod
    def of(cls, raw: Sequence[Any]) -> WindowReply:
        """The reply from the script's array: each field at its place (:data:`REPLY_PLACES`),
        then the tasks reported, three items each."""
        head = list(raw[:_REPLY_LENGTH])
        rooms = head[_ROOMS]
        head[_ROOMS] = tuple(int(v) for v in rooms.split(b",")) if isinstance(rooms, bytes) and rooms else ()
        reported = tuple(Reported(_decoded(raw[i]), _payload(raw[i + 1], raw[i + 2]), _decoded(raw[i + 2]))
                         for i in range(_REPLY_LENGTH, len(raw) - 2, 3))
        return cls(*head, reported)  # type: ignore[call-arg]  # (the script's fields, in their order)


#: Where each field of a window script's reply sits (1-based, as Lua counts): the script
#: reads them as REPLY_<FIELD>, written in by the loader (store/compose.py), and
#: :meth:`WindowReply.of` reads the array the same way. The order is WindowReply's own.
REPLY_PLACES = {f"REPLY_{name.upper()}": place for place, name in enumerate(WindowReply._fields[:-1], 1)}
_REPLY_LENGTH = len(REPLY_PLACES)
_ROOMS = WindowReply._fields.index("rooms")


def _decoded(value: bytes | str) -> str:
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else value


def _payload(value: Any, kind: bytes | str) -> bytes | str | None:
    if value is None:
        return None
    return value if _decoded(kind) in ("r", "x", "c") else _decoded(value)


def window_argv(now: str, op: str, call: WindowCall, *args: Any, cost: Cost | None = None) -> list[Any]:
    """ARGV of window operation ``op`` on ``call``: window.lua's head, then the operation's
    own arguments as its file of lua/op/ lists them (``tests/pure/test_script_format.py`` holds the two
    together). ``cost``: a settle's difference, in place of the call's cost."""
    return [*call.head(now, op, cost), *args]


@lru_cache(maxsize=1024)
def _rate_args(algorithm: str, rates: tuple[Rate, ...], fields: tuple[str, ...] | None = None,
               adapt: tuple[float, float, float] | None = None) -> tuple[int | str, ...]:
    # (An adaptive throttle's law follows the count: '2;0.1,0.7,0.005'; repr, the shortest
    # text that reads back as the same double in Lua.)
    args: list[int | str] = [len(rates) if adapt is None else f"{len(rates)};{','.join(map(repr, adapt))}"]
    for i, rate in enumerate(rates):
        args += [rate.limit, rate.period_us, fields[i] if fields else rate_field(algorithm, rate)]
    return tuple(args)


