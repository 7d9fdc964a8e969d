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
    "PUBLISH_HINTS_KEPT",
    "PUBLISH_HINT_MAX",
    "QUICK_TIMEOUT",
    "RELEASER_BATCH",
    "RESEND_PATIENCE",
    "RESEND_RETRY_DELAY",
    "RESEND_RETRY_MAX_DELAY",
    "SCREEN_RTT_MAX_US",
    "SCRIPT_POLICY",
    "STORE_CONNECT_TIMEOUT",
    "STORE_ERROR_PAUSE",
    "STORE_TIMEOUT",
    "WORKER_BATCH",
    "ScriptPolicy",
    "as_declared",
    "declared_period_us",
    "default_margin_us",
    "lease_span_us",
    "release_lead_us",
    "round_trip_allowance_us",
    "shortest_us",
    "slack_us",
    "wait_here_us",
    "widened_period_us",
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
#: A re-send the broker refused (a deleted exchange, a full queue, a broker out of memory)
#: is tried again by this process no sooner than this (seconds), doubling with each refusal
#: in a row up to the cap: with ``acks_late`` the broker hands the message straight back,
#: and without a pause every process would check and re-send it once per round trip.
RESEND_RETRY_DELAY, RESEND_RETRY_MAX_DELAY = 0.25, 5.0
#: How long (seconds) a process keeps trying to send back a task whose message was acked
#: when its pool took it (``acks_late`` off): it is the only copy, so it is not given up at
#: the first refusal; past this the task fails visibly (``ResendRefused``) rather than hold
#: a pool process for the length of a broker's fault.
RESEND_PATIENCE = 30.0

#: The longest (seconds) a producer trusts a key's room learnt at publish: within it,
#: it sends up to that room unchecked (a hint, taken from the check's reply; it never
#: exceeds the key's shortest window). Longer saves calls for keys sent to now and then;
#: shorter re-reads the room sooner when a queue fills while no worker counts it.
PUBLISH_HINT_MAX = 60.0
#: Keys a producer keeps hints for at most (the least recently learnt are forgotten).
PUBLISH_HINTS_KEPT = 10_000

#: The default margin of a sliding window (``throttle_margin`` unset): 2% of its length,
#: at most 20 ms (µs). Our starts are N to a window by the Redis clock; the requests they
#: make reach an API some milliseconds later, not all equally late (p50 4 ms, max 14-29 ms
#: in bench section 11), and a moving-window API counts their arrivals. Without a margin a
#: 10/s task drew 1.3-2 429s per 100 requests cold; with 20 ms, none. It costs a saturated
#: 1 s window 2% of its pace, and an hourly quota nothing worth naming.
MARGIN_SHARE, MARGIN_MAX_US = 0.02, 20_000
#: A store round trip (µs) counts in a release's lead from this long on (a store on the
#: same host or network answers in well under it), in steps of this.
RTT_COUNTS_FROM_US, RTT_STEP_US = 5_000, 10_000
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
#: A lease: 1/4 of the shortest window, between these (µs). A process asks for one only
#: while it makes two calls of a key within the span, so the span sets how busy a key must
#: be to skip the round trip: at 1/10, ten tenants of a 1 s window on 2 processes at
#: 500 tasks a second took 0.60 script calls a task (bench section 12), at 1/4 0.23-0.27. It is
#: also how long a lease outlives a reset or a lowered limit; leases are granted only
#: while every rate stays at most half full, so they never decide how close a key runs.
LEASE_PARTS, LEASE_MIN_US, LEASE_MAX_US = 4, 2_000, 1_000_000
#: A task is released this many slacks before its start while nothing is learnt of its
#: key's dispatch delay (the first arrivals teach it), and never more than LEAD_MAX_US.
LEAD_SLACKS, LEAD_MAX_US = 4, 500_000
#: The longest a released task that arrives early waits for its start in the worker (µs)
#: rather than going back to the line; it holds a pool process meanwhile.
WAIT_HERE_MAX_US = 1_000_000
#: Heads of a line a check in a worker or a producer may release on its way (its caller
#: sends them): a refund or a body that ends lets the next tasks go at once, and the call
#: stays short. The releasers take what is left, RELEASER_BATCH per call.
WORKER_BATCH, RELEASER_BATCH = 8, 64



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
    #: The learnt dispatch delay (one sample of it) is at most 1/this of the shortest
    #: window: a stalled worker cannot teach the key to release its tasks a large part of
    #: a window early.
    learnt_cap_parts: int = 10
    #: A released task that arrives later than this (ms) after its release is not learnt
    #: at all: no worker was running, or its pool was busy, while it waited. Such a trip
    #: is not the dispatch delay, and learning it would make the key release its tasks
    #: that far ahead for long after.
    learn_outlier_ms: int = 1000
    #: The gains of the delay estimator, as 1/this: TCP's smoothed round trip and its
    #: mean deviation (RFC 6298's 1/8 and 1/4).
    delay_gain_parts: int = 8
    jitter_gain_parts: int = 4
    #: A task is released the learnt delay plus this many deviations before its start (so
    #: most arrive before it and are granted it), at most half the busiest rate's spacing.
    lead_jitters: int = 2
    #: How many entries of a line one call looks at, at most, when it puts back or
    #: forgets released tasks whose time is up, or releases heads: a script's running
    #: time does not grow with the line (a deep line is worked off call by call).
    line_batch: int = 64
    #: How long (ms) a released task's message stays with its releaser before it counts as
    #: not sent (the releaser died between the script and the broker): it is then put
    #: back in its place in the line. A send takes milliseconds; one slower than this is
    #: harmless (a copy released again finds its ticket used, and is dropped), one lost
    #: with its worker should not wait long.
    send_lease_ms: int = 10_000
    #: How long (ms) a released task that was sent may take to arrive (behind a queue, in
    #: a worker's prefetch, behind a pool slower than the limit) before its room is given
    #: back. It is not lost: if it comes later, it is checked as a fresh call.
    out_lease_ms: int = 600_000
    #: How long (ms) the concurrency slot handed to a released task that was sent stays
    #: its own (at most its out lease). One that arrives later takes a free slot, as any
    #: call, or waits in its line again. A release whose start the store lost (a failover
    #: that took the claim's last writes; its body ran) held its key's slot for the whole
    #: out lease, and a key of `concurrency=2` with two of them started nothing for ten
    #: minutes.
    handed_slot_ms: int = 30_000
    #: How long (ms) past a start granted early its entry is kept, for a process that
    #: woke too late for it (it gives the start back and is checked again).
    grant_keep_ms: int = 1_000
    #: How long (ms) a key remembers the entries that started: a copy of such a task that
    #: comes within it (sent again after a store error whose reply was lost, or delivered
    #: twice by the broker) is dropped, not run twice. As long as a released task may take
    #: to arrive: a copy later than that is checked as a new task.
    used_keep_ms: int = 600_000
    #: A start granted ahead is counted over this many slacks from it: one for the process
    #: that waits for it to wake, one for the body (a process that wakes later gives it
    #: back and is checked again).
    grant_slacks: int = 2
    #: A key whose index entry was last written longer ago than this (ms) is written
    #: again by the next call on it: an index entry lost (an evicted index; on a Redis
    #: Cluster, a writer that died between the script and the index) comes back with the
    #: key's next call.
    index_stale_ms: int = 5_000
    #: A key's next look this close (ms) wakes a releaser at once, from the call that tells
    #: the index of it (releasers sleep a second at most between looks, else until the
    #: earliest look they know of).
    wake_ahead_ms: int = 1_000
    #: Places in a key's line a level of priority goes ahead of: a task of urgency u
    #: (core/priority.py) joins before the u times this many tasks that came last before it. Large enough that an urgent task passes a tenant's nightly
    #: batch (9 levels on a Redis broker: 90 000 tasks); finite, so that no task of urgency u
    #: waits behind more than (v - u) times this many tasks that came after it, v the highest
    #: urgency among them (the aging rule).
    priority_step: int = 10_000
    #: Levels of priority ahead of (or behind) a broker's default, at most: AMQP's 255.
    most_urgency: int = 255

    def values(self) -> dict[str, int]:
        """Each constant by its name in the scripts."""
        return {f.name.upper(): getattr(self, f.name) for f in fields(self)}


#: The policy the scripts are loaded with.
SCRIPT_POLICY = ScriptPolicy()


@lru_cache(maxsize=1024)
def _shortest_us(rates: tuple[Rate, ...]) -> int:
    return min((r.period_us for r in rates), default=1_000_000)


def shortest_us(rates: Sequence[Rate]) -> int:
    """The shortest window of ``rates`` (µs; a second when there are none)."""
    return _shortest_us(tuple(rates))


def slack_us(rates: Sequence[Rate]) -> int:
    """How long after a check the body may start and still count as starting then (µs)."""
    return min(max(_shortest_us(tuple(rates)) // SLACK_PARTS, SLACK_MIN_US), SLACK_MAX_US)


def lease_span_us(rates: Sequence[Rate]) -> int:
    """How long the units of a lease may be used (µs)."""
    return min(max(_shortest_us(tuple(rates)) // LEASE_PARTS, LEASE_MIN_US), LEASE_MAX_US)


@lru_cache(maxsize=1024)
def release_lead_us(rates: tuple[Rate, ...], far_us: int = 0) -> int:
    """How long before its start a task is released while nothing is learnt of its key
    (µs; window.lua learns the real dispatch delay from the first arrivals): LEAD_SLACKS
    slacks, at most half the busiest rate's spacing (a task released early waits for its
    start in a pool process) and LEAD_MAX_US; plus ``far_us`` for a store far away (the
    release's reply, and the claim, each travel half a round trip)."""
    half_pace = min((r.period_us // r.limit // 2 for r in rates), default=LEAD_MAX_US)
    return min(LEAD_SLACKS * slack_us(rates), half_pace, LEAD_MAX_US) + far_us


def round_trip_allowance_us(rtt_us: int) -> int:
    """A store's measured round trip, as it counts in a release's lead (µs): 0 under
    RTT_COUNTS_FROM_US (a local store), else the round trip rounded up to RTT_STEP_US (a
    few values, so the calls of a key keep their cached shape)."""
    if rtt_us < RTT_COUNTS_FROM_US:
        return 0
    return -(-rtt_us // RTT_STEP_US) * RTT_STEP_US


def default_margin_us(period_us: int) -> int:
    """The margin a sliding window of ``period_us`` gets by default (MARGIN_SHARE)."""
    return min(round(period_us * MARGIN_SHARE), MARGIN_MAX_US)


def widened_period_us(period_us: int, margin: float | None) -> int:
    """The window a sliding rate of ``period_us`` is counted over with ``margin`` (seconds;
    None: :func:`default_margin_us`), as a call binds it."""
    return period_us + (default_margin_us(period_us) if margin is None else round(margin * 1_000_000))


def declared_period_us(counted_us: int) -> int | None:
    """The window a sliding window of ``counted_us`` was declared as, if it is one widened
    by the default margin (:func:`default_margin_us`), else None."""
    for declared in (counted_us - MARGIN_MAX_US, round(counted_us / (1 + MARGIN_SHARE))):
        if declared > 0 and declared + default_margin_us(declared) == counted_us:
            return declared
    return None


def as_declared(rate: Rate) -> Rate:
    """``rate`` as declared, when its window is one widened by the default margin."""
    declared = declared_period_us(rate.period_us)
    return rate if declared is None else Rate(rate.limit, declared / 1_000_000, rate.unit)


def wait_here_us(lead: int, slack: int) -> int:
    """How early a released task may arrive and still be granted its start, to wait for it
    in the worker (µs): twice the lead it was released with, or 4 slacks, at most
    WAIT_HERE_MAX_US."""
    return min(max(2 * lead, 4 * slack), WAIT_HERE_MAX_US)
