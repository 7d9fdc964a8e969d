"""The timing policy: every duration the throttle chooses, named, with the reason for it.

Durations of a check are worked out from the call's rates (the shortest window, the
busiest rate's spacing) and passed to window.lua as explicit values; the rest are
how long the optional paths wait on Redis and how often things are read again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import lru_cache

from .rates import Rate

__all__ = [
    "CONTROL_REFRESH",
    "PUBLISH_GRACE_US",
    "PUBLISH_HINTS_KEPT",
    "PUBLISH_HINT_MAX",
    "QUICK_TIMEOUT",
    "SCREEN_RTT_MAX_US",
    "SCRIPT_POLICY",
    "STORE_CONNECT_TIMEOUT",
    "STORE_ERROR_PAUSE",
    "STORE_TIMEOUT",
    "ScriptPolicy",
    "default_margin_us",
    "grace_us",
    "lead_us",
    "lease_span_us",
    "reservation_grace_us",
    "round_trip_allowance_us",
    "shortest_us",
    "slack_us",
    "wait_here_us",
]

#: How long (seconds) the pool's check waits on Redis for a reply, and for a connection
#: (``throttle_redis_options`` may say otherwise): a Redis that does not answer within
#: them is a store error, and ``throttle_on_store_error`` decides.
STORE_TIMEOUT, STORE_CONNECT_TIMEOUT = 5.0, 2.0
#: How long (seconds) the consumer's screen and the check at publish wait on Redis at
#: most: both are optional (the pool's check decides every start), and a consumer that
#: waits on a slow Redis stops taking every other message too.
QUICK_TIMEOUT = 0.25
#: After a store error in one of those optional checks, it is skipped for this long
#: (seconds): messages go to the pool unscreened, tasks are sent unchecked.
STORE_ERROR_PAUSE = 5.0
#: How stale (seconds) a process's copy of the controls (pauses, live limits) may be: a
#: control set elsewhere is obeyed by every worker within this. One small read per
#: process per interval, whatever the task rate.
CONTROL_REFRESH = 0.5

#: The longest (seconds) a producer trusts a key's room learnt at publish: within it,
#: it sends up to that room unchecked (a hint, taken from the check's reply; it never
#: exceeds the key's shortest window). Longer saves calls for keys sent to now and then;
#: shorter re-reads the room sooner when a queue fills while no worker counts it.
PUBLISH_HINT_MAX = 60.0
#: The least grace (µs) of a start reserved at publish (window.lua caps it at 1/10 of the
#: shortest window). A task that fits now is reserved a start now and must reach a worker
#: within it, behind whatever the queue holds; with the pool's 2% (20 ms for a 1 s window)
#: a burst's first window was missed (claims came late, gave their start back after the
#: window had passed, and went to the back of the line: a second without starts in the
#: demo). The cost: a saturated key fed only at publish stretches each window by it.
PUBLISH_GRACE_US = 100_000
#: Keys a producer keeps hints for at most (the least recently learnt are forgotten).
PUBLISH_HINTS_KEPT = 10_000

#: The default margin of a sliding window (``throttle_margin`` unset): 2% of its length,
#: at most 20 ms (µs). Our starts are N to a window by the Redis clock; the requests they
#: make reach an API some milliseconds later, not all equally late (p50 4 ms, max 14-29 ms
#: in bench section 11), and a moving-window API counts their arrivals. Without a margin a
#: 10/s task drew 1.3-2 429s per 100 requests cold; with 20 ms, none. It costs a saturated
#: 1 s window 2% of its pace, and an hourly quota nothing worth naming.
MARGIN_SHARE, MARGIN_MAX_US = 0.02, 20_000
#: A store round trip (µs) counts in the grace and the lead from this long on (a store
#: on the same host or network answers in well under it), in steps of this.
RTT_COUNTS_FROM_US, RTT_STEP_US = 5_000, 10_000
#: A reserved start far from its store stays open this many round trips: one for the
#: claim to reach the store, one for a claim that waits behind others in a busy pool
#: (each claim holds a pool process for a round trip: 4 processes take 4 claims per
#: trip, and a window's starts come due together). At most 1/FAR_GRACE_CAP_PARTS of the
#: shortest window: each window of a saturated key is stretched by its grace.
FAR_GRACE_TRIPS, FAR_GRACE_CAP_PARTS = 2, 4
#: Connections a pool process opens to a store far away as it starts (its checks', and
#: a second for the controls read in the background): a connection made on demand costs
#: redis-py's handshake, several round trips (0.3-0.7 s at 100 ms), and the first check
#: that meets another thread using the only one would wait that long, mid-burst.
FAR_WARM_CONNECTIONS = 2
#: The consumer screens no message when the store is at least this far (µs): it screens
#: one message at a time, so a store 100 ms away would let it take at most 10 messages a
#: second, whatever the pool could do. The pool's processes check in parallel instead.
SCREEN_RTT_MAX_US = RTT_COUNTS_FROM_US
#: The slack: 1/100 of the shortest window, between these (µs). A busy machine can
#: deschedule a process between the check and the first line of the body.
SLACK_PARTS, SLACK_MIN_US, SLACK_MAX_US = 100, 2_000, 20_000
#: A lease: 1/10 of the shortest window, between these (µs).
LEASE_PARTS, LEASE_MIN_US, LEASE_MAX_US = 10, 2_000, 1_000_000
#: The grace of a reserved start: 2% of the shortest window, between these (seconds),
#: and never under GRACE_SLACKS slacks.
GRACE_SHARE, GRACE_MIN, GRACE_MAX, GRACE_SLACKS = 0.02, 0.01, 2.0, 3
#: The longest a reserved task is sent back early before anything is learnt (µs).
LEAD_MAX_US = 500_000
#: The longest an early arrival waits for its start in the worker (µs) rather than
#: going back through the broker; it holds a pool process meanwhile.
WAIT_HERE_MAX_US = 1_000_000



@dataclass(frozen=True)
class ScriptPolicy:
    """The timing policy inside window.lua, given to it when the scripts are loaded (each
    field becomes a Lua constant of the same name in capitals; ``tests/reference.py``
    reads the same values). Tests load the scripts with other values."""

    #: Passes over a call's rates in search of a start every rate admits. Each pass only
    #: moves the start later, and two or three rates settle in two or three passes; a
    #: call whose rates still disagree after this many is denied without a start, and
    #: checks again when it comes back.
    settle_rounds: int = 64
    #: How long (ms) a window's state, and the marker of a used reservation, outlive the
    #: last unit they count: a call at that very edge, or one whose Redis clock reads a
    #: little behind, still finds them.
    state_ttl_pad_ms: int = 1000
    #: The learnt dispatch delay (one sample of it) and a reservation's grace are at most
    #: 1/this of the shortest window: a stalled worker cannot teach the key to send tasks
    #: back, or hold starts open, for a large part of a window.
    learnt_cap_parts: int = 10
    #: A claim that comes back later than this (ms) after it was due is not learnt at
    #: all: no worker was running, or the releaser had stopped, while it waited. Such a
    #: trip is not the dispatch delay, and learning it would make the key reserve starts
    #: at publish that far ahead for long after the workers are back.
    learn_outlier_ms: int = 1000
    #: The gains of the delay estimator, as 1/this: TCP's smoothed round trip and its
    #: mean deviation (RFC 6298's 1/8 and 1/4).
    delay_gain_parts: int = 8
    jitter_gain_parts: int = 4
    #: A denied task is sent back the learnt delay plus this many deviations early (so most
    #: arrive before their start), at most half the busiest rate's spacing.
    lead_jitters: int = 2
    #: A reservation's grace covers this many deviations plus this many slacks once a
    #: delay is learnt: busy workers widen it, idle ones keep it tight.
    grace_jitters: int = 4
    grace_slacks: int = 2
    #: How long (ms) a key's count of tasks held back at publish is kept after its last
    #: one (``throttle status`` shows it): a day of them, then it starts again from 0.
    held_count_ttl_ms: int = 86_400_000

    def values(self) -> dict[str, int]:
        """Each constant by its name in the scripts."""
        return {f.name.upper(): getattr(self, f.name) for f in fields(self)}


#: The policy the scripts are loaded with.
SCRIPT_POLICY = ScriptPolicy()


@lru_cache(maxsize=1024)
def _shortest_us(rates: tuple[Rate, ...]) -> int:
    return min(r.period_us for r in rates)


def shortest_us(rates: Sequence[Rate]) -> int:
    """The shortest window of ``rates`` (µs)."""
    return _shortest_us(tuple(rates))


def slack_us(rates: Sequence[Rate]) -> int:
    """How long after a check the body may start and still count as starting then (µs)."""
    return min(max(_shortest_us(tuple(rates)) // SLACK_PARTS, SLACK_MIN_US), SLACK_MAX_US)


def lease_span_us(rates: Sequence[Rate]) -> int:
    """How long the units of a lease may be used (µs)."""
    return min(max(_shortest_us(tuple(rates)) // LEASE_PARTS, LEASE_MIN_US), LEASE_MAX_US)


@lru_cache(maxsize=1024)
def grace_us(rates: tuple[Rate, ...], start_grace: float | None = None) -> int:
    """How long after its reserved start a deferred task may still use it (µs).

    It absorbs the broker's and the pool's dispatch delays; each window of a saturated
    sliding limit is stretched by it, so it stays a small fraction. At least 3 slacks: a
    claim must leave one slack before the span ends, and a late arrival (a stall of a
    few tens of ms) costs the task a whole window. ``start_grace`` (seconds, the
    setting) replaces the share of the window.
    """
    grace = start_grace
    if grace is None:
        grace = min(max(_shortest_us(rates) / 1e6 * GRACE_SHARE, GRACE_MIN), GRACE_MAX)
    return max(int(grace * 1_000_000), GRACE_SLACKS * slack_us(rates))


def reservation_grace_us(rates: tuple[Rate, ...], start_grace: float | None, least_us: int, far_us: int) -> int:
    """The grace a start reserved for a call of ``rates`` is given (µs), before what the
    key learns widens it: :func:`grace_us`, or ``least_us`` if more (at publish), at most
    1/learnt_cap_parts of the shortest window, as window.lua caps what it learns; and
    FAR_GRACE_TRIPS round trips of a store far away (``far_us``: its
    :func:`round_trip_allowance_us`), up to 1/FAR_GRACE_CAP_PARTS."""
    shortest = _shortest_us(rates)
    grace = min(max(grace_us(rates, start_grace), least_us), shortest // SCRIPT_POLICY.learnt_cap_parts)
    return max(grace, min(FAR_GRACE_TRIPS * far_us, shortest // FAR_GRACE_CAP_PARTS))


def lead_us(rates: Sequence[Rate], grace: int, learnt: int = -1) -> int:
    """How early a reserved task is sent back; it waits out the rest in the worker (µs).

    The key's learnt dispatch delay and margin once there are some (see window.lua);
    before that, the grace plus as much again, at most half the busiest rate's spacing
    (every early task holds a pool process while it waits) and LEAD_MAX_US.
    """
    if learnt >= 0:
        return learnt
    half_pace = min(r.period_us // r.limit // 2 for r in rates)
    return min(grace + min(grace, half_pace), LEAD_MAX_US)


def round_trip_allowance_us(rtt_us: int) -> int:
    """A store's measured round trip, as it counts in a reservation's grace and lead (µs): 0
    under RTT_COUNTS_FROM_US (a local store), else the round trip rounded up to
    RTT_STEP_US (a few values, so the calls of a key keep their cached shape)."""
    if rtt_us < RTT_COUNTS_FROM_US:
        return 0
    return -(-rtt_us // RTT_STEP_US) * RTT_STEP_US


def default_margin_us(period_us: int) -> int:
    """The margin a sliding window of ``period_us`` gets by default (MARGIN_SHARE)."""
    return min(round(period_us * MARGIN_SHARE), MARGIN_MAX_US)


def wait_here_us(lead: int, slack: int) -> int:
    """How early an arrival may be and still wait for its start in the worker (µs):
    twice the lead it was sent back with, or 4 slacks, at most WAIT_HERE_MAX_US."""
    return min(max(2 * lead, 4 * slack), WAIT_HERE_MAX_US)
