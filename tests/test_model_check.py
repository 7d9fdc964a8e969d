"""The Lua windows, checked against a Python model of them, and against plain truth.

Every operation runs on the real scripts (through ``RedisStore`` with an injected clock)
and on ``tests.reference.WindowModel``; the replies must agree field for field, and the
hash must hold what the model holds. Separately, every call that actually started
(immediate admissions at their time, reservations claimed on time at their claim time;
and again with each body starting late within its slack, where the script promises it
may) is fed to a truth checker that knows nothing of buckets: no interval of one period
(sliding) or aligned window (fixed) may ever hold more units than the limit. A reset
deletes the hash and forgets, on purpose: the truth is checked per epoch.
"""

from __future__ import annotations

import copy
import math
import random
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_throttle.keys import state_key
from celery_throttle.protocol import (
    STATE_FORMAT,
    Code,
    Counted,
    Reservation,
    StateLayout,
    WindowCall,
    WindowReply,
    rate_field,
)
from celery_throttle.rates import Rate, parse_rate
from celery_throttle.store import RedisStore
from celery_throttle.timing import SCRIPT_POLICY, ScriptPolicy
from tests.helpers import QUICK, STORE_URL, redis_or_skip
from tests.reference import (
    SLOTS,
    ModelReply,
    SlidingRate,
    WindowModel,
    max_units_in_any_interval,
    max_units_per_aligned_window,
    per_rate,
)

#: A call's cost: units of every rate, or a count per rate (rates of different units).
Cost = int | tuple[int, ...]

ALGORITHMS = ("sliding", "fixed")
#: A plausible "now": late 2023 in µs, well below 2**53.
BASE_US = 1_700_000_000_000_000

RATE_SETS: dict[str, tuple[str, ...]] = {
    "one": ("5/s",),
    "two": ("5/s", "12/3s"),
    "three": ("3/s", "10/10s", "40/m"),
    "same-period": ("3/s", "5/s"),
    "wide": ("50/s", "200/10s"),
    "day": ("100/d",),
    "tiny-periods": ("1/ms", "3/5ms", "4/10ms"),
    # Rates of different units (requests and tokens of one API): a call counts a cost of
    # each unit, each rate its own unit's.
    "requests-tokens": ("5/s", "40 tokens/s"),
    "rpm-tpm": ("3/s", "25 tokens/s", "60 tokens/10s"),
    "two-named": ("4 requests/s", "9 calls/2s", "30 tokens/s"),
    # (room for leases of calls of two units: half of each window holds several)
    "wide-tokens": ("50/s", "400 tokens/s", "1000 tokens/10s"),
}
#: The sets whose rates count one unit (a lease is of one count for every rate: a call of
#: several units takes none, which the walks of every set check).
ONE_UNIT_SETS = {name: rates for name, rates in RATE_SETS.items() if not any(" " in r for r in rates)}


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_client() -> Iterator[redis.Redis]:
    client = redis_or_skip(STORE_URL)
    yield client
    client.close()


@pytest.fixture
def key_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A prefix of this test's own; every key under it is deleted afterwards."""
    prefix = f"ct-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    for key in redis_client.scan_iter(match=f"{prefix}:*", count=1000):
        redis_client.delete(key)


class FakeClock:
    """Now, in µs, as the tests say; passed to the scripts as ARGV[1]."""

    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(BASE_US)


@pytest.fixture
def store(redis_client: redis.Redis, key_prefix: str, clock: FakeClock) -> Iterator[RedisStore]:
    s = RedisStore(STORE_URL, key_prefix, clock=clock)
    yield s
    s.close()


def rates_of(names: Sequence[str]) -> tuple[Rate, ...]:
    return tuple(parse_rate(n) for n in names)


def by_op(store: RedisStore, key: str, op: str, call: WindowCall, *, reserve: bool = False,
          claim: Reservation | None = None, lease: int = 0, lease_span_us: int = 0,
          resumed: bool = False, early_us: int = 0) -> WindowReply:
    """The store's method for ``op`` (the walks pick operations at random)."""
    if op == "claim":
        assert claim is not None
        return store.claim(key, call, claim, reserve=reserve, resumed=resumed, early_us=early_us)
    if op == "acquire":
        return store.acquire(key, call, reserve=reserve, lease=lease, lease_span_us=lease_span_us)
    if op == "screen":
        return store.screen(key, call, reserve=reserve)
    if op == "admit":
        return store.admit(key, call)
    return store.reserve(key, call) if op == "reserve" else store.peek(key, call)


# -- the harness: one hash, the script and the model side by side --------------------------


@dataclass
class Harness:
    """Runs each operation on Redis and on the model, and keeps the truth."""

    store: RedisStore
    clock: FakeClock
    key: str
    algorithm: str
    rates: tuple[Rate, ...]
    rng: random.Random
    model: WindowModel = field(init=False)
    #: (time, units) of every call that started, at the time it was told to start; one
    #: list per epoch (a reset forgets what came before, on purpose).
    eras: list[list[tuple[int, int]]] = field(default_factory=lambda: [[]])
    #: The same, with each body starting at a random moment of its slack where the
    #: script promises that it may.
    jittered_eras: list[list[tuple[int, int]]] = field(default_factory=lambda: [[]])
    #: Reservations handed out and not yet claimed (some never will be: lost tasks).
    pending: list[Reservation] = field(default_factory=list)
    #: The wait of the last denied call: jumping exactly there is a good edge case.
    last_wait: int = 0
    history: list[str] = field(default_factory=list)
    #: Leases the script granted (the walk must exercise them).
    leases: int = 0
    #: Calls that started where the script counted them (not those of a lease), with the
    #: units they are counted with now (what a settle adjusts), and where their entries
    #: are in the truth's lists (era, entry, jittered entry).
    started: list[tuple[Counted, tuple[int, int, int]]] = field(default_factory=list)
    #: The scope's pause (ctl.pause, a Backoff): nothing starts before it (0: none).
    paused_until: int = 0
    #: A pause ending further away than this reserves nothing (park_after in a worker).
    pause_horizon: int = 0

    def __post_init__(self) -> None:
        #: Where check_observable_state peeks (apart from the walk's own choices).
        self.probe_rng = random.Random(zlib.crc32(f"probe/{self.algorithm}".encode()))
        self.model = WindowModel(self.algorithm, [(r.limit, r.period_us, r.unit) for r in self.rates],
                                 policy=self.store.policy, layout=self.store.layout)
        #: The units the rates count, in order of first appearance ([""]: the call's own).
        self.units = list(dict.fromkeys(r.unit for r in self.rates))

    @property
    def min_limit(self) -> int:
        return min(r.limit for r in self.rates)

    @property
    def min_period(self) -> int:
        return min(r.period_us for r in self.rates)

    @property
    def max_period(self) -> int:
        return max(r.period_us for r in self.rates)

    @property
    def admissions(self) -> list[tuple[int, int]]:
        return [a for era in self.eras for a in era]

    def reset(self) -> None:
        """Delete the hash (what a reset, an expiry or a lost Redis does)."""
        self.store.delete(self.key)
        self.model.reset()
        self.eras.append([])
        self.jittered_eras.append([])
        self.history.append(f"reset at now={self.clock.now}")
        # The next epoch is the time of the next write: make sure it differs from the
        # last one, which may be now (epochs are µs; two in the same µs cannot happen
        # with Redis's clock, but can with a test clock that stands still).
        self.advance(1)

    def advance(self, dt: int) -> None:
        assert dt >= 0
        self.clock.now += dt
        self.history.append(f"advance {dt} -> now={self.clock.now}")

    def run(
        self,
        op: str,
        cost: Cost,
        *,
        reserve: bool = False,
        grace_us: int = 0,
        slack_us: int = 0,
        claim: Reservation | None = None,
        lease: int = 0,
        lease_span_us: int = 0,
        max_wait_us: int = 0,
        resumed: bool = False,
        early_us: int = 0,
    ) -> WindowReply:
        now = self.clock.now
        paused = self.paused_until
        call = WindowCall(self.algorithm, self.rates, cost, grace_us=grace_us, slack_us=slack_us,
                          max_wait_us=max_wait_us, not_before_us=paused, pause_horizon_us=self.pause_horizon)
        got = by_op(self.store, self.key, op, call, reserve=reserve, claim=claim, lease=lease,
                    lease_span_us=lease_span_us, resumed=resumed, early_us=early_us)
        want = self.model.window(now, op, cost, reserve=reserve, grace_us=grace_us, slack_us=slack_us,
                                 claim=claim, resumed=resumed, lease=lease, lease_span_us=lease_span_us,
                                 max_wait_us=max_wait_us, not_before_us=paused,
                                 pause_horizon_us=self.pause_horizon, early_us=early_us)
        self.history.append(
            f"{op} cost={cost} reserve={reserve} resumed={resumed} early={early_us} grace={grace_us} slack={slack_us} "
            f"claim={claim and claim.to_header()} lease={lease}/{lease_span_us} max_wait={max_wait_us} "
            f"not_before={paused} at now={now} "
            f"-> {tuple(got)}"
        )
        # Then the script decided exactly what the model decided
        assert tuple(got) == want.as_tuple(), self.explain(
            f"script replied {tuple(got)}, model {want.as_tuple()} "
            "(code, wait, remaining, clear_at, start, latest, now, epoch)"
        )
        # and nothing started in a pause, nor was reserved to start in one
        if now < paused and op != "peek":
            assert got.code != Code.RUN, self.explain("ran in a pause")
            assert not got.start_us or got.start_us >= paused or got.code == Code.EARLY, \
                self.explain("reserved a start in a pause")
        leased = got.leased if op == "acquire" else 0  # (an admit's is its room, not a lease)
        self.leases += 1 if leased else 0
        self._account(op, cost, max(slack_us, lease_span_us) if leased else slack_us, claim, got)
        self.check_observable_state()
        self.check_stored_state()
        # The script's TTLs are real milliseconds computed from the test clock: keep the
        # hash from expiring in real time while a slow machine runs the walk (TTLs have
        # their own test below).
        # (not PEXPIRE ... GT: that is Redis 7, and the suite runs on 6.2 too)
        if self.store.client.pttl(self.key) < 600_000:
            self.store.client.pexpire(self.key, 600_000)
        return got

    def _account(self, op: str, cost: Cost, slack_us: int, claim: Reservation | None,
                 got: WindowReply) -> None:
        now = self.clock.now
        if claim is not None and got.code != Code.EARLY:
            # Claimed on time (runs), or late (given back, maybe replaced below).
            self.pending.remove(claim)
        if op == "peek" or (op in ("screen", "admit") and got.code == Code.RUN):
            return  # nothing recorded: the pool's acquire comes next
        if got.code in (Code.RUN, Code.RUN_AT):
            # (Granted a little early, RUN_AT: it starts at its start, after its wait.)
            at = now + got.wait_us if got.code == Code.RUN_AT else now
            # A lease counts `leased` units of every rate, or (a cost per rate) that many
            # calls of this one's cost.
            leased: Cost = got.leased if isinstance(cost, int) else tuple(got.leased * c for c in cost)
            self.eras[-1].append((at, leased if got.leased else cost))
            # The body may start up to `slack` later: the script promises that for an
            # on-time claim (now + slack <= latest), for one granted early (start + slack
            # <= latest) and for an immediate admission (a sliding window records [now,
            # now + slack]; a fixed one counts it in every window that span touches). A
            # lease's units start anywhere in its span.
            # (A lease's units start anywhere in its span: one by one, or call by call.)
            pieces: list[Cost] = [cost] if not got.leased else [1 if isinstance(cost, int) else cost] * got.leased
            for units in pieces:
                self.jittered_eras[-1].append((at + self.rng.randint(0, slack_us), units))
            # (Where its entries are in the truth's lists: a settle changes them there.)
            at = (len(self.eras) - 1, len(self.eras[-1]) - 1, len(self.jittered_eras[-1]) - 1)
            if claim is not None and got.start_us:
                self.started.append((Counted(claim.start_us, claim.start_us + claim.grace_us, claim.cost,
                                             got.epoch), at))
            elif not got.leased:
                self.started.append((Counted(now, now + slack_us, cost, got.epoch), at))
            else:  # (from a lease: a refund stays counted, an overrun counts from the report)
                self.started.append((Counted(0, slack_us, cost, 0), (-1, -1, -1)))
        elif got.code in (Code.DENIED, Code.RESERVED):
            self.last_wait = got.wait_us
            # (a start is reserved exactly when the code says so)
            assert (got.code == Code.RESERVED) == (got.start_us > 0), self.explain(f"code {got.code} with start {got.start_us}")
            if got.start_us:
                self.pending.append(Reservation(got.start_us, got.latest_us, cost, got.grace_us, got.epoch,
                                                self.rng.randint(0, 30_000)))

    def settle(self, index: int, reported: Cost) -> WindowReply:
        """The call ``started[index]`` reports that it cost ``reported`` units (of each rate)."""
        counted, (era, entry, jittered) = self.started[index]
        n = len(self.rates)
        deltas = tuple(r - u for r, u in zip(per_rate(reported, n), per_rate(counted.units, n)))
        delta: Cost = deltas if isinstance(reported, tuple) or isinstance(counted.units, tuple) else deltas[0]
        call = WindowCall(self.algorithm, self.rates, 1)
        got = self.store.settle(self.key, call, counted, delta)
        claim = Reservation(counted.start_us, counted.latest_us, delta, 0, counted.epoch)
        want = self.model.window(self.clock.now, "settle", 1, claim=claim)
        self.history.append(f"settle {counted} delta={delta} at now={self.clock.now} -> {tuple(got)}")
        assert tuple(got) == want.as_tuple(), self.explain(f"settle: script replied {tuple(got)}, model "
                                                           f"{want.as_tuple()}")
        if counted.start_us and str(counted.epoch) == str(self.model.epoch):  # (the truth counts what it reported)
            self.eras[era][entry] = (self.eras[era][entry][0], reported)
            self.jittered_eras[era][jittered] = (self.jittered_eras[era][jittered][0], reported)
        self.started[index] = (Counted(counted.start_us, counted.latest_us, reported, counted.epoch),
                               (era, entry, jittered))
        self.check_observable_state()
        self.check_stored_state()
        return got

    def check_observable_state(self) -> None:
        """What the state answers, whatever its layout: a peek at a moment ahead (within two
        of the shortest windows, at random) agrees with the model's, asked of a copy of it
        (a peek ahead loads, and forgets, what has left the window by then). A change of
        layout or encoding leaves this oracle as it is; check_stored_state is the other half."""
        ahead = self.clock.now + self.probe_rng.randint(1, 2 * self.min_period)
        saved, self.clock.now = self.clock.now, ahead
        try:
            got = self.store.peek(self.key, WindowCall(self.algorithm, self.rates, 1))
        finally:
            self.clock.now = saved
        want = copy.deepcopy(self.model).window(ahead, "peek", 1)
        assert tuple(got) == want.as_tuple(), self.explain(
            f"a peek ahead, at {ahead}, answered {tuple(got)}, model {want.as_tuple()}")

    def check_stored_state(self) -> None:
        """The encoding: the hash holds, field by field, what the model's layout says."""
        raw = self.store.client.hgetall(self.key)
        stored = {k.decode(): v for k, v in raw.items()}
        live = self.model.live_stored_fields(stored, self.clock.now)
        assert live == self.model.fields(), self.explain(
            f"hash holds {sorted(live.items())}, model {sorted(self.model.fields().items())}"
        )

    def check_invariant(self) -> None:
        for admissions, jittered in zip(self.eras, self.jittered_eras):
            self._check_era(admissions, jittered)

    def _check_era(self, admissions: list[tuple[int, Cost]], jittered: list[tuple[int, Cost]]) -> None:
        if self.algorithm == "sliding":
            worst_of, where = max_units_in_any_interval, "within one period"
        else:
            worst_of, where = max_units_per_aligned_window, "in one aligned window"
        n = len(self.rates)
        for i, rate in enumerate(self.rates):
            for starts, how in ((admissions, ""), (jittered, " when bodies start late within their slack")):
                worst = worst_of([(t, per_rate(units, n)[i]) for t, units in starts], rate.period_us)
                assert worst <= rate.limit, self.explain(
                    f"{worst} units started {where} of {rate} (limit {rate.limit}){how}")

    def explain(self, what: str) -> str:
        tail = "\n  ".join(self.history[-25:])
        return f"{what}\n{self.algorithm} {[str(r) for r in self.rates]}, last operations:\n  {tail}"

    # -- random choices, scaled to the rates ------------------------------------------------
    def random_cost(self) -> Cost:
        """Mostly 1, often up to the tightest limit, sometimes above it (refused: code -1);
        with rates of several units, a cost of each (one number, now and then, for all)."""
        if len(self.units) == 1 or self.rng.random() < 0.1:
            return self._one_cost(self.min_limit)
        return self.spread({u: self._one_cost(min(r.limit for r in self.rates if r.unit == u)) for u in self.units})

    def _one_cost(self, limit: int) -> int:
        roll = self.rng.random()
        if roll < 0.7:
            return 1
        if roll < 0.96:
            return self.rng.randint(1, limit)
        return limit + self.rng.randint(1, 3)

    def spread(self, by_unit: dict[str, int]) -> Cost:
        """A cost per unit as the script is sent it: a count per rate, each its unit's."""
        return tuple(by_unit[r.unit] for r in self.rates)

    def costed(self, cost: int) -> Cost:
        """``cost`` of the call's first unit, and (rates of several units) a cost of each
        other unit up to its tightest limit (hypothesis' walks pick the first)."""
        if len(self.units) == 1:
            return cost
        first, *others = self.units
        return self.spread({first: cost, **{u: self.rng.randint(1, min(r.limit for r in self.rates if r.unit == u))
                                            for u in others}})

    def random_report(self, estimate: Cost, overruns: bool) -> Cost:
        """What a call estimated at ``estimate`` reports it really cost: at most the
        estimate, or (``overruns``) up to three times it; per unit."""
        if isinstance(estimate, int):
            return self.rng.randint(0, 3 * estimate if overruns else estimate)
        by_unit = {r.unit: units for r, units in zip(self.rates, estimate)}
        return self.spread({u: self.rng.randint(0, 3 * e if overruns else e) for u, e in by_unit.items()})

    def lease_of(self, cost: Cost, calls: int) -> int:
        """A lease of ``calls`` calls of ``cost``, as the script is told it: units of every
        rate for a call of one cost, calls for a call with a cost per rate."""
        return cost * calls if isinstance(cost, int) else calls

    def random_grace(self) -> int:
        p = self.min_period
        limiter_like = int(min(max(p * 0.02, 10_000), 2_000_000))
        return self.rng.choice([0, 1, 1000, limiter_like, self.rng.randint(0, p // 5 + 1), p])

    def random_max_wait(self) -> int:
        """Mostly no cap; sometimes one that a deep enough wait passes."""
        return self.rng.choice([0, 0, 0, 1, self.min_period // 2, self.max_period, 3 * self.max_period])

    def random_early(self) -> int:
        """How early a claim may come and be granted its start: mostly not at all, or by a
        share of the shortest window (a worker's wait-here distance)."""
        p = self.min_period
        return self.rng.choice([0, 0, 1, p // 20, p // 5, self.rng.randint(0, p)])

    def random_slack(self) -> int:
        p = self.min_period
        return self.rng.choice([0, 1, min(2000, p // 100), self.rng.randint(0, p // 10 + 1)])

    def random_step(self) -> int:
        rng, now = self.rng, self.clock.now
        roll = rng.random()
        if roll < 0.2:
            return rng.randint(0, 100)
        if roll < 0.4:
            return rng.randint(0, max(math.ceil(self.min_period / SLOTS), 1000))
        if roll < 0.6:
            return rng.randint(0, self.min_period)
        if roll < 0.7:
            return rng.randint(0, self.max_period)
        if roll < 0.77:
            p = rng.choice(self.rates).period_us
            return rng.randint(p, 3 * p)  # past the window
        if roll < 0.87 and self.pending:
            r = rng.choice(self.pending)
            target = rng.choice([r.start_us - 1, r.start_us, r.latest_us, r.latest_us + 1])
            return max(target - now, 0)
        if roll < 0.94:
            return self.last_wait + rng.choice([-1, 0, 0, 1]) if self.last_wait > 0 else 0
        p = rng.choice(self.rates).period_us
        boundary = (now // p + 1) * p
        return max(boundary + rng.choice([-1, 0, 1]) - now, 0)

    def random_operation(self) -> None:
        roll = self.rng.random()
        if roll < 0.01:
            self.reset()
        elif roll < 0.025:
            # Pause for up to two windows (ctl.pause / a Backoff), or resume.
            p = self.max_period
            self.paused_until = self.clock.now + self.rng.randint(1, 2 * p) if self.rng.random() < 0.7 else 0
            self.pause_horizon = self.rng.randint(1, p)
            self.history.append(f"paused until {self.paused_until}")
        elif roll < 0.3:
            self.advance(self.random_step())
        elif roll < 0.42:
            cost = self.random_cost()
            self.run("acquire", cost, slack_us=self.random_slack(),
                     lease=self.lease_of(cost, self.rng.randint(1, 12)), lease_span_us=self.random_slack() * 5)
        elif roll < 0.5:
            self.run("acquire", self.random_cost(), slack_us=self.random_slack())
        elif roll < 0.7:
            self.run("acquire", self.random_cost(), reserve=True, grace_us=self.random_grace(),
                     slack_us=self.random_slack(), max_wait_us=self.random_max_wait())
        elif roll < 0.73:
            self.run("screen", self.random_cost(), reserve=True, grace_us=self.random_grace(),
                     slack_us=self.random_slack())
        elif roll < 0.745:
            self.run("reserve", self.random_cost(), grace_us=self.random_grace(), slack_us=self.random_slack())
        elif roll < 0.76:
            self.run("admit", self.random_cost(), grace_us=self.random_grace(), slack_us=self.random_slack())
        elif roll < 0.8:
            self.run("peek", self.random_cost())
        elif self.pending:
            claim = self.rng.choice(self.pending)
            self.run("claim", claim.cost, reserve=self.rng.random() < 0.8, claim=claim,
                     grace_us=self.random_grace(), slack_us=self.random_slack(),
                     resumed=self.rng.random() < 0.1, early_us=self.random_early())
        else:
            self.run("acquire", self.random_cost(), reserve=True, grace_us=self.random_grace())


def new_harness(store: RedisStore, clock: FakeClock, algorithm: str, names: Sequence[str],
                seed: int) -> Harness:
    rng = random.Random(seed)
    clock.now = BASE_US + rng.randint(0, 10**12)  # windows aligned anywhere
    key = state_key(store.prefix, f"model-{algorithm}", uuid.uuid4().hex)
    return Harness(store, clock, key, algorithm, rates_of(names), rng)


# -- long random walks --------------------------------------------------------------------

#: Operations per walk (`make quick`: fewer; the full suite is the proof).
STEPS = 150 if QUICK else 400


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rate_set", sorted(RATE_SETS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_script_matches_model_and_never_overfills_a_window(
    store: RedisStore, clock: FakeClock, algorithm: str, rate_set: str, seed: int
) -> None:
    # Given one hash, several rates at once, and a seeded random walk of acquires,
    # reservations, peeks, claims (early, on time, late) and time jumps
    stable_seed = zlib.crc32(f"{algorithm}/{rate_set}/{seed}".encode())
    h = new_harness(store, clock, algorithm, RATE_SETS[rate_set], seed=stable_seed)
    for _ in range(STEPS):
        # When each operation runs on the script and on the model
        h.random_operation()
    # Then (checked at every step) they agreed, and no window ever held too much
    h.check_invariant()
    assert h.admissions, "the walk admitted nothing: it tested nothing"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rate_set", sorted(RATE_SETS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_leases_match_the_model_and_never_overfill_a_window(
    store: RedisStore, clock: FakeClock, algorithm: str, rate_set: str, seed: int
) -> None:
    # Given one hash and a seeded walk of leased acquires (granted only while every rate
    # stays half full), plain acquires, reservations and time jumps: from an empty
    # window, through the half-full line, to the limit
    stable_seed = zlib.crc32(f"lease/{algorithm}/{rate_set}/{seed}".encode())
    h = new_harness(store, clock, algorithm, RATE_SETS[rate_set], seed=stable_seed)
    rng, tight = h.rng, min(h.rates, key=lambda r: r.limit)
    for _ in range(STEPS // 2):
        roll = rng.random()
        # When each operation runs on the script and on the model
        if roll < 0.25:
            h.advance(rng.randint(0, 2 * h.min_period // max(tight.limit, 1) + 1))
        elif roll < 0.3:
            h.advance(rng.randint(h.max_period, 2 * h.max_period))
        elif roll < 0.8:
            # (Of several units: a small cost of each, and a lease of calls like it.)
            cost: Cost = rng.choice([1, 1, 2]) if len(h.units) == 1 else h.spread(
                {u: rng.choice([1, 1, 2]) for u in h.units})
            h.run("acquire", cost, slack_us=h.random_slack(),
                  lease=h.lease_of(cost, rng.randint(2, max(2, tight.limit // 3))), lease_span_us=h.random_slack() * 5)
        elif roll < 0.9:
            h.run("acquire", 1, slack_us=h.random_slack())
        else:
            h.run("acquire", 1, reserve=True, grace_us=h.random_grace(), slack_us=h.random_slack())
    # Then they agreed at every step, no window held too much with every leased unit
    # started anywhere in its span, and leases were granted where one fits in half a
    # window (2 units need a limit of 4), never elsewhere (of several units, the walk
    # is sure to find one only with room for 2 calls of 2 in half the tightest window)
    h.check_invariant()
    if tight.limit < 4:
        assert h.leases == 0
    elif len(h.units) == 1 or tight.limit >= 8:
        assert h.leases, "no lease was granted: the walk tested nothing"


#: A timing policy unlike the default in every field: the scripts must use what they
#: are loaded with (a search that may give up after two rounds, other gains and caps).
ODD_POLICY = ScriptPolicy(settle_rounds=2, state_ttl_pad_ms=700, learnt_cap_parts=4, delay_gain_parts=2,
                          jitter_gain_parts=3, lead_jitters=1, grace_jitters=6, grace_slacks=3)


#: A state layout unlike the default in every field: few buckets per window and few kept,
#: few fixed windows ahead, so that walks fold all the time.
ODD_LAYOUT = StateLayout(slots=7, max_buckets=10, max_ahead=3, keep_ahead=1)


@pytest.mark.parametrize("rate_set", sorted(RATE_SETS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("loaded_with", ["policy", "layout"])
def test_script_matches_model_under_another_timing_policy_or_state_layout(
    redis_client: redis.Redis, key_prefix: str, clock: FakeClock, algorithm: str, rate_set: str, loaded_with: str
) -> None:
    # Given the scripts and the model both loaded with another timing policy, or another
    # state layout
    odd = {"policy": ODD_POLICY} if loaded_with == "policy" else {"layout": ODD_LAYOUT}
    store = RedisStore(STORE_URL, key_prefix, clock=clock, **odd)
    try:
        h = new_harness(store, clock, algorithm, RATE_SETS[rate_set],
                        seed=zlib.crc32(f"{loaded_with}/{algorithm}/{rate_set}".encode()))
        # When a random walk runs on both (and, with the layout, a deep backlog: the state
        # folds as the layout says)
        for _ in range(STEPS):
            h.random_operation()
        if loaded_with == "layout":
            _deep_walk(h, lambda: 1, DEEP // 3)
        # Then they agreed at every step, and no window held too much
        h.check_invariant()
        assert h.admissions, "the walk admitted nothing: it tested nothing"
    finally:
        store.close()


# -- the same, explored by hypothesis -----------------------------------------------------


#: Mostly 1, often a few, sometimes more than the tightest limit (refused with -1).
COSTS = st.one_of(st.just(1), st.integers(1, 5), st.integers(1, 60))


class WindowMachine(RuleBasedStateMachine):
    """Hypothesis picks the operations; shrinking gives a short failing sequence."""

    store: RedisStore
    clock: FakeClock

    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None

    @initialize(algorithm=st.sampled_from(ALGORITHMS), rate_set=st.sampled_from(sorted(RATE_SETS)),
                offset=st.integers(0, 10**12), seed=st.integers(0, 2**16))
    def start(self, algorithm: str, rate_set: str, offset: int, seed: int) -> None:
        self.h = new_harness(self.store, self.clock, algorithm, RATE_SETS[rate_set], seed)
        self.clock.now = BASE_US + offset

    def teardown(self) -> None:
        if self.h is not None:
            self.store.delete(self.h.key)

    @rule(dt=st.integers(0, 2000))
    def tick(self, dt: int) -> None:
        assert self.h is not None
        self.h.advance(dt)

    @rule(permille=st.integers(0, 3500))
    def jump(self, permille: int) -> None:
        assert self.h is not None
        self.h.advance(self.h.max_period * permille // 1000)

    @rule(extra=st.sampled_from([-1, 0, 1]))
    def jump_to_last_wait(self, extra: int) -> None:
        assert self.h is not None
        self.h.advance(max(self.h.last_wait + extra, 0))

    @precondition(lambda self: self.h is not None and self.h.pending)
    @rule(index=st.integers(0, 10**6), edge=st.sampled_from(["before", "start", "latest", "after"]))
    def jump_to_reservation_edge(self, index: int, edge: str) -> None:
        assert self.h is not None
        r = self.h.pending[index % len(self.h.pending)]
        target = {"before": r.start_us - 1, "start": r.start_us,
                  "latest": r.latest_us, "after": r.latest_us + 1}[edge]
        self.h.advance(max(target - self.clock.now, 0))

    @rule(cost=COSTS, slack=st.sampled_from([0, 1, 2000, 10_000]))
    def acquire(self, cost: int, slack: int) -> None:
        assert self.h is not None
        self.h.run("acquire", self.h.costed(cost), slack_us=slack)

    @rule(cost=COSTS, calls=st.integers(1, 12), span=st.sampled_from([0, 1, 2000, 50_000]),
          slack=st.sampled_from([0, 2000]))
    def acquire_a_lease(self, cost: int, calls: int, span: int, slack: int) -> None:
        assert self.h is not None
        costed = self.h.costed(cost)
        self.h.run("acquire", costed, slack_us=slack, lease=self.h.lease_of(costed, calls), lease_span_us=span)

    @rule(cost=COSTS, grace=st.sampled_from([0, 1, 10_000, 20_000, 500_000]),
          slack=st.sampled_from([0, 2000]))
    def acquire_or_reserve(self, cost: int, grace: int, slack: int) -> None:
        assert self.h is not None
        self.h.run("acquire", self.h.costed(cost), reserve=True, grace_us=grace, slack_us=slack)

    @rule(cost=COSTS, grace=st.sampled_from([0, 10_000, 500_000]), slack=st.sampled_from([0, 2000]))
    def reserve_at_publish(self, cost: int, grace: int, slack: int) -> None:
        assert self.h is not None
        self.h.run("reserve", self.h.costed(cost), grace_us=grace, slack_us=slack)

    @rule(cost=COSTS, grace=st.sampled_from([0, 10_000, 500_000]), slack=st.sampled_from([0, 2000]))
    def admit_at_publish(self, cost: int, grace: int, slack: int) -> None:
        assert self.h is not None
        self.h.run("admit", self.h.costed(cost), grace_us=grace, slack_us=slack)

    @rule(cost=COSTS, max_wait=st.sampled_from([1, 500_000, 3_000_000]))
    def reserve_no_further_than(self, cost: int, max_wait: int) -> None:
        assert self.h is not None
        self.h.run("acquire", self.h.costed(cost), reserve=True, grace_us=10_000, max_wait_us=max_wait)

    @rule()
    def reset(self) -> None:
        assert self.h is not None
        self.h.reset()

    @rule(cost=COSTS)
    def peek(self, cost: int) -> None:
        assert self.h is not None
        self.h.run("peek", self.h.costed(cost))

    @precondition(lambda self: self.h is not None and self.h.pending)
    @rule(index=st.integers(0, 10**6), reserve=st.booleans(),
          grace=st.sampled_from([0, 10_000, 20_000]), slack=st.sampled_from([0, 2000]),
          early=st.sampled_from([0, 1, 50_000, 10**6]))
    def claim(self, index: int, reserve: bool, grace: int, slack: int, early: int) -> None:
        assert self.h is not None
        c = self.h.pending[index % len(self.h.pending)]
        self.h.run("claim", c.cost, reserve=reserve, grace_us=grace, slack_us=slack, claim=c, early_us=early)

    @invariant()
    def no_window_overfilled(self) -> None:
        if self.h is not None:
            self.h.check_invariant()


def test_script_matches_model_on_hypothesis_chosen_sequences(
    store: RedisStore, clock: FakeClock
) -> None:
    WindowMachine.store, WindowMachine.clock = store, clock
    run_state_machine_as_test(
        WindowMachine,
        settings=settings(max_examples=10 if QUICK else 60, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )


# -- edges, one by one --------------------------------------------------------------------


@pytest.mark.parametrize("op", ["acquire", "peek", "claim"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cost_above_a_limit_is_refused_with_minus_one_and_changes_nothing(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis, algorithm: str, op: str
) -> None:
    # Given a hash holding one admission, under "10/m" and "3/s"
    rates = rates_of(["10/m", "3/s"])
    key = state_key(store.prefix, "costly", "t")
    assert store.acquire(key, WindowCall(algorithm, rates, 1)).allowed
    before = redis_client.hgetall(key)
    clock.now += 1000
    # When a call costs 4, more than the 3 of "3/s"
    epoch = int(store.read(key)["e"])
    claim = Reservation(clock.now, clock.now + 10, 4, 10, epoch) if op == "claim" else None
    reply = by_op(store, key, op, WindowCall(algorithm, rates, 4), reserve=True, claim=claim)
    # Then it is refused with its code, and nothing written
    assert tuple(reply) == (Code.TOO_COSTLY, 0, 0, 0, 0, 0, clock.now, 0, -1, 0, 0, ())
    assert not reply.allowed
    assert redis_client.hgetall(key) == before


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_cost_equal_to_the_limit_fits_an_empty_window(store: RedisStore, algorithm: str) -> None:
    rates = rates_of(["3/s"])
    key = state_key(store.prefix, "exact", algorithm)
    reply = store.acquire(key, WindowCall(algorithm, rates, 3))
    assert reply.allowed and reply.remaining == 0
    assert store.peek(key, WindowCall(algorithm, rates, 1)).code == Code.DENIED


GARBLED = {
    "empty": b"",
    "not msgpack": b"\xc1",
    "a string": msgpack.packb("x"),
    "one number": msgpack.packb(5),
    "a header cut short": msgpack.packb(5) + msgpack.packb(BASE_US),
    "a list holding a string": msgpack.packb([BASE_US, "x"]),
}


@pytest.mark.parametrize("value", GARBLED.values(), ids=GARBLED.keys())
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_window_state_that_does_not_decode_counts_for_nothing_and_is_replaced(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis, algorithm: str, value: bytes
) -> None:
    # Given a rate's field holding something no script wrote
    rates = rates_of(["3/s"])
    key = state_key(store.prefix, "garbled", algorithm)
    field = rate_field(algorithm, rates[0])
    redis_client.hset(key, field, value)
    # When a call checks that rate
    reply = store.acquire(key, WindowCall(algorithm, rates, 1))
    # Then the field counted nothing, and holds a state the scripts wrote
    assert reply.allowed and reply.remaining == 2
    decode = WindowModel(algorithm, [(3, 1_000_000)]).rates[0].decode
    assert decode(redis_client.hget(key, field))[1::2] == [1]
    assert store.peek(key, WindowCall(algorithm, rates, 1)).remaining == 2


def test_a_sliding_state_written_as_one_flat_list_still_counts(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis
) -> None:
    # Given a sliding field as earlier versions wrote it: one list of latest, units
    rates = rates_of(["3/s"])
    key = state_key(store.prefix, "flat", "t")
    field = rate_field("sliding", rates[0])
    redis_client.hset(key, field, msgpack.packb([clock.now - 500_000, 1, clock.now - 1000, 1]))
    # When a call comes, and again once the older bucket has left the window
    first = store.acquire(key, WindowCall("sliding", rates, 1))
    clock.now += 600_000
    second = store.peek(key, WindowCall("sliding", rates, 1))
    # Then both buckets counted, then only the newer one (and the one just admitted)
    assert first.allowed and first.remaining == 0
    assert second.remaining == 1
    assert SlidingRate.decode(redis_client.hget(key, field))[1::2] == [1, 1, 1]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_reservation_made_before_a_reset_is_checked_afresh(
    store: RedisStore, clock: FakeClock, algorithm: str
) -> None:
    # Given a full "1/s" window and a reservation for the next free start
    rates = rates_of(["1/s"])
    key = state_key(store.prefix, "epoch", algorithm)
    assert store.acquire(key, WindowCall(algorithm, rates, 1)).allowed
    denied = store.acquire(key, WindowCall(algorithm, rates, 1, grace_us=20_000), reserve=True)
    assert denied.code == Code.RESERVED and denied.start_us > clock.now and denied.epoch
    reservation = Reservation(denied.start_us, denied.latest_us, 1, 20_000, denied.epoch)
    # When the state is reset (or expires, or Redis loses it), and at the reserved start
    # another call takes the only unit of the new state
    store.delete(key)
    clock.now = reservation.start_us
    fresh = store.acquire(key, WindowCall(algorithm, rates, 1))
    assert fresh.allowed and fresh.epoch == clock.now != reservation.epoch
    # Then the old reservation, claimed on time, is not honoured: it is an ordinary
    # acquire in the new state (denied: the unit is taken) and gives nothing back
    claimed = store.claim(key, WindowCall(algorithm, rates, 1), reservation)
    assert (claimed.code, claimed.start_us) == (Code.DENIED, 0)
    assert store.peek(key, WindowCall(algorithm, rates, 1)).remaining == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("op", ["acquire", "screen", "peek", "claim"])
def test_a_state_of_another_format_is_started_afresh_and_one_without_is_ours(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis, algorithm: str, op: str
) -> None:
    # Given a full "2/s" window, and a start reserved in it
    rates = rates_of(["2/s"])
    key = state_key(store.prefix, "format", f"{algorithm}-{op}")
    for _ in range(2):
        assert store.acquire(key, WindowCall(algorithm, rates, 1)).allowed
    denied = store.acquire(key, WindowCall(algorithm, rates, 1, grace_us=20_000), reserve=True)
    reservation = Reservation(denied.start_us, denied.latest_us, 1, 20_000, denied.epoch)
    assert redis_client.hget(key, "f") == str(STATE_FORMAT).encode()
    # When the hash has no format field (written before it existed), it is read as ours
    redis_client.hdel(key, "f")
    assert store.peek(key, WindowCall(algorithm, rates, 1)).remaining == 0
    # But when it says another format (a later version wrote it, the deploy rolled back)
    redis_client.hset(key, "f", STATE_FORMAT + 1)
    claim = reservation if op == "claim" else None
    clock.now = reservation.start_us if claim is not None else clock.now + 1000
    reply = by_op(store, key, op, WindowCall(algorithm, rates, 1), reserve=True, claim=claim)
    # Then it is started afresh: nothing it counted counts, no reservation of it holds
    # (the claim is an ordinary acquire of a new state), and a write makes it ours
    assert reply.code == Code.RUN and reply.start_us == 0
    assert reply.remaining == (2 if op in ("screen", "peek") else 1)
    assert reply.epoch == (0 if op in ("screen", "peek") else clock.now) != reservation.epoch
    if op in ("acquire", "claim"):
        assert redis_client.hget(key, "f") == str(STATE_FORMAT).encode()


def test_fixed_admission_at_the_end_of_a_window_counts_where_it_may_start(
    store: RedisStore, clock: FakeClock
) -> None:
    # Given a fixed "2/s" window, a 10 ms slack, and the clock at the last µs of a window
    rates, slack, period = rates_of(["2/s"]), 10_000, 1_000_000
    key = state_key(store.prefix, "fixed-slack", "t")
    clock.now = (BASE_US // period + 5) * period - 1
    # When a call of cost 2 is admitted there, and another of cost 2 asks 1 µs later
    first = store.acquire(key, WindowCall("fixed", rates, 2, slack_us=slack))
    first_may_start_at = clock.now + slack  # in the next window
    clock.now += 1
    second = store.acquire(key, WindowCall("fixed", rates, 2, slack_us=slack))
    # Then the next window does not see more than its limit start
    started = [(first_may_start_at, 2)] if first.allowed else []
    started += [(clock.now, 2)] if second.allowed else []
    assert max_units_per_aligned_window(started, period) <= 2, (first, second)


@pytest.mark.parametrize("pad_ms", [SCRIPT_POLICY.state_ttl_pad_ms, 300])
def test_state_gets_a_ttl_covering_every_counted_unit_then_expires(
    redis_client: redis.Redis, key_prefix: str, pad_ms: int
) -> None:
    # Given a clock frozen at the real time (TTLs are real milliseconds; frozen, no
    # window boundary can pass between the calls), short windows, and the scripts loaded
    # with the policy's TTL pad or another
    store = RedisStore(STORE_URL, key_prefix, clock=FakeClock(time.time_ns() // 1000),
                       policy=ScriptPolicy(state_ttl_pad_ms=pad_ms))
    rates = (Rate(2, 0.2),)  # 2 per 200 ms
    keys = {}
    try:
        for algorithm in ALGORITHMS:
            key = state_key(key_prefix, "ttl", algorithm)
            keys[algorithm] = key
            # When it admits two calls, then reserves a third in a later window
            for _ in range(2):
                assert store.acquire(key, WindowCall(algorithm, rates, 1, slack_us=2000)).allowed
            reply = store.acquire(key, WindowCall(algorithm, rates, 1, grace_us=20_000), reserve=True)
            assert reply.code == Code.RESERVED and reply.start_us > reply.now_us
            # Then the hash lives at least until the last counted unit leaves its window,
            # plus the pad it was loaded with, and at most one more window (the headroom a
            # TTL is grown by)
            pttl = redis_client.pttl(key)
            needed_ms = math.ceil((reply.clear_at_us - reply.now_us) / 1000) + pad_ms
            headroom_ms = 200
            assert needed_ms - 100 <= pttl <= needed_ms + headroom_ms, (algorithm, pttl, needed_ms)
        deadline = time.monotonic() + 3.0
        while any(redis_client.exists(k) for k in keys.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        # And once it has passed, nothing of the prefix is left
        assert list(redis_client.scan_iter(match=f"{key_prefix}:*")) == []
    finally:
        store.close()


def test_reset_forgets_every_window_of_a_key(redis_client: redis.Redis, key_prefix: str) -> None:
    from celery import Celery

    from celery_throttle.limiter import Throttle

    app = Celery("ct-model-check", set_as_current=False)
    throttle = Throttle(app, {"redis_url": STORE_URL, "key_prefix": key_prefix})
    try:
        # Given a key at its limit under two rates, and another key in use
        for _ in range(2):
            assert throttle.acquire("reset-scope", "tenant-a", ["2/m", "5/h"]).allowed
        assert throttle.acquire("reset-scope", "tenant-b", ["2/m"]).allowed
        assert not throttle.acquire("reset-scope", "tenant-a", ["2/m", "5/h"]).allowed
        # When the first key is reset
        assert throttle.reset("reset-scope", "tenant-a") is True
        # Then its hash is gone, the next call is admitted, the other key is untouched
        assert not redis_client.exists(state_key(key_prefix, "reset-scope", "tenant-a"))
        assert throttle.reset("reset-scope", "tenant-a") is False
        decision = throttle.acquire("reset-scope", "tenant-a", ["2/m", "5/h"])
        assert decision.allowed and decision.remaining == 1
        assert throttle.status("reset-scope", "tenant-b").remaining == 1
        # And after resetting both, nothing of the prefix is left
        throttle.reset("reset-scope", "tenant-a")
        throttle.reset("reset-scope", "tenant-b")
        assert list(redis_client.scan_iter(match=f"{key_prefix}:*")) == []
    finally:
        throttle.store.close()


def test_sliding_day_limit_memory_stays_flat_after_5000_admissions(
    store: RedisStore, clock: FakeClock, redis_client: redis.Redis
) -> None:
    # Given a sliding 100000/d limit
    rates = rates_of(["100000/d"])
    key = state_key(store.prefix, "memory", "t")
    step = int(1.5 * 86_400_000_000 / 5000)  # 5000 admissions spread over a day and a half
    worst = 0
    for i in range(5000):
        # When each admission comes some 26 s after the last
        clock.now += step
        assert store.acquire(key, WindowCall("sliding", rates, 1, slack_us=2000)).allowed
        if i % 250 == 249:
            worst = max(worst, redis_client.memory_usage(key, samples=0))
    # Then the hash keeps one field for the rate, holding one bucket per SLOTS-th of the
    # day (a day's span touches at most SLOTS + 1 of them), and its epoch field; under 4 kB
    assert sorted(redis_client.hkeys(key)) == [b"e", b"f", b"s100000/86400000000"]
    assert len(SlidingRate.decode(redis_client.hget(key, "s100000/86400000000"))) <= 2 * (SLOTS + 1)
    assert worst < 4096, f"MEMORY USAGE reached {worst} bytes"


# -- deep backlogs ------------------------------------------------------------------------

#: Rate sets for thousands of reservations on one key.
DEEP_SETS: dict[str, tuple[str, ...]] = {
    "1/s": ("1/s",),
    "10/s+1000/h": ("10/s", "1000/h"),
    "5/s+12/3s": ("5/s", "12/3s"),
}
#: Reservations outstanding at the deepest point of a walk (`make quick`: shallower).
DEEP = 400 if QUICK else 1500
#: What the state of one key may take, however deep its backlog (bytes of the hash's values).
DEEP_STATE_BYTES = 4096


def _timings(rates: Sequence[Rate]) -> tuple[int, int]:
    """(grace, slack) as the limiter gives them for these rates."""
    from celery_throttle.timing import grace_us as _grace_us
    from celery_throttle.timing import slack_us as _slack_us

    return _grace_us(tuple(rates), None), _slack_us(tuple(rates))


def _state_bytes(h: Harness) -> int:
    return sum(len(v) for v in h.store.client.hvals(h.key))


def _deep_walk(h: Harness, cost_of: Callable[[], int], depth: int) -> int:
    """Fills the key, denies ``depth`` calls (each reserves a start), then brings a third
    of them back first come, first served: most on time, some late (given back and
    reserved again), between fresh calls. Returns the largest state seen, in bytes."""
    rng = h.rng
    grace, slack = _timings(h.rates)
    worst = 0
    while h.run("acquire", 1, slack_us=slack).allowed:
        pass
    for i in range(depth):
        if rng.random() < 0.05:
            h.advance(rng.randint(0, h.min_period // 20))
        h.run("acquire", cost_of(), reserve=True, grace_us=grace, slack_us=slack)
        if i % 100 == 99:
            worst = max(worst, _state_bytes(h))
    for i in range(depth // 3):
        if not h.pending:
            break  # (a shallow walk's backlog can be used up by its on-time claims)
        first = min(h.pending, key=lambda r: r.start_us)
        roll, early = rng.random(), 0
        if roll < 0.75:  # on time, somewhere in its grace
            h.advance(max(first.start_us + rng.randint(0, max(first.latest_us - first.start_us - slack, 0))
                          - h.clock.now, 0))
        elif roll < 0.85:  # a little early, and granted its start (a worker's wait here)
            early = rng.randint(1, max(h.min_period // 20, 1))
            h.advance(max(first.start_us - rng.randint(0, early) - h.clock.now, 0))
        elif roll < 0.95:  # too late: given back, queued again
            h.advance(max(first.latest_us + 1 - h.clock.now, 0))
        else:  # a fresh call arrives first
            h.run("acquire", cost_of(), reserve=True, grace_us=grace, slack_us=slack)
            continue
        h.run("claim", first.cost, reserve=True, claim=first, grace_us=grace, slack_us=slack, early_us=early)
        if i % 50 == 49:
            worst = max(worst, _state_bytes(h))
    return worst


@pytest.mark.parametrize("costs", ["one", "mixed"])
@pytest.mark.parametrize("rate_set", sorted(DEEP_SETS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_deep_backlog_matches_the_model_stays_small_and_never_overfills_a_window(
    store: RedisStore, clock: FakeClock, algorithm: str, rate_set: str, costs: str
) -> None:
    # Given one key at its limit, and 1500 calls denied one after another, each
    # reserving a start (costs of 1, or mixed up to the tightest limit)
    h = new_harness(store, clock, algorithm, DEEP_SETS[rate_set],
                    seed=zlib.crc32(f"deep/{algorithm}/{rate_set}/{costs}".encode()))
    choices = [1] if costs == "one" else sorted({1, 2, h.min_limit})

    # When they come back first come, first served (some late), between fresh calls
    worst = _deep_walk(h, lambda: h.rng.choice(choices), DEEP)

    # Then the script agreed with the model at every step (state included), no window
    # ever held too much, and the key's state stayed within a few kB throughout
    h.check_invariant()
    assert len(h.admissions) > DEEP // 10, "the walk admitted too little: it tested nothing"
    assert worst <= DEEP_STATE_BYTES, f"the state grew to {worst} bytes"


@pytest.mark.parametrize("cost", [1, 2])
@pytest.mark.parametrize("rate_set", sorted(DEEP_SETS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_folding_a_deep_backlog_changes_no_decision_for_calls_of_one_cost(
    algorithm: str, rate_set: str, cost: int
) -> None:
    # Given the model as the scripts run it (folding a deep backlog) and the same model
    # keeping every window and bucket, fed the same calls of one cost
    rates = rates_of(DEEP_SETS[rate_set])
    if cost > min(r.limit for r in rates):
        pytest.skip("cost above the tightest limit")
    pairs = [(r.limit, r.period_us) for r in rates]
    folded, exact = WindowModel(algorithm, pairs), WindowModel(algorithm, pairs, fold=False)
    grace, slack = _timings(rates)
    rng = random.Random(zlib.crc32(f"fold/{algorithm}/{rate_set}/{cost}".encode()))
    now = BASE_US + rng.randint(0, 10**12)
    pending: list[Reservation] = []
    biggest = {"folded": 0, "exact": 0}

    def both(op: str, claim: Reservation | None = None) -> ModelReply:
        got = folded.window(now, op, cost, reserve=True, grace_us=grace, slack_us=slack, claim=claim)
        want = exact.window(now, op, cost, reserve=True, grace_us=grace, slack_us=slack, claim=claim)
        # Then every reply is the same, field for field
        assert got == want, (op, now, claim)
        if got.code == Code.RESERVED:
            pending.append(Reservation(got.start_us, got.latest_us, cost, got.grace_us, got.epoch, 0))
        return got

    # When 1500 calls are denied, then a third of them come back on time (or late),
    # first come first served, between fresh calls
    for _ in range(DEEP):
        now += rng.randint(0, 3)  # (all of them before the first reserved start)
        both("acquire")
    biggest = {"folded": _size(folded), "exact": _size(exact)}
    for _ in range(DEEP // 3):
        first = min(pending, key=lambda r: r.start_us)
        now = max(now, first.start_us + rng.randint(0, max(first.latest_us - first.start_us - slack, 0)))
        pending.remove(first)
        both("claim", claim=first)
        if rng.random() < 0.1:
            both("acquire")
    # And at the deepest point, the folded state was a small fraction of the exact one
    assert biggest["folded"] * 4 < biggest["exact"], biggest


def _size(model: WindowModel) -> int:
    """How many numbers the model's rates hold."""
    return sum(len(str(r.entries()).split(",")) for r in model.rates)


def test_a_task_late_for_its_start_after_a_refill_runs_on_the_unit_it_gives_back(
    store: RedisStore, clock: FakeClock
) -> None:
    # Given a sliding 3/s quota spent at once, and 3 tasks that reserved the refill
    rates, key = rates_of(["3/s"]), state_key(store.prefix, "refill", "t")
    assert store.acquire(key, WindowCall("sliding", rates, 3, slack_us=2000)).allowed
    held = [store.acquire(key, WindowCall("sliding", rates, 1, grace_us=20_000, slack_us=2000), reserve=True)
            for _ in range(3)]
    first = held[0]
    # When the first comes back after its reserved span (a slow release), the spent
    # quota's units long out of the window
    clock.now = first.latest_us + 5000
    claim = Reservation(first.start_us, first.latest_us, 1, first.grace_us, first.epoch, 0)
    reply = store.claim(key, WindowCall("sliding", rates, 1, grace_us=20_000, slack_us=2000), claim, reserve=True)
    # Then it runs now, on the unit it gave back, not one window later
    assert reply.code == Code.RUN, reply


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_reservation_claimed_long_after_its_start_teaches_no_dispatch_delay(
    store: RedisStore, clock: FakeClock, algorithm: str
) -> None:
    # Given a key whose tasks come back 20 ms after they were due (learnt from a claim)
    rates = rates_of(["10/h"])
    key = state_key(store.prefix, "outlier", algorithm)
    call = WindowCall(algorithm, rates, 1, grace_us=2_000_000)

    def claim_after(late_us: int) -> int:
        reply = store.reserve(key, call)
        clock.now = reply.start_us + late_us
        store.claim(key, call, Reservation(reply.start_us, reply.latest_us, 1, reply.grace_us, reply.epoch))
        return store.peek(key, call).lead_us

    learnt = claim_after(20_000)
    assert learnt > 0
    # When a reservation made while no worker ran is claimed a minute after its start
    # (a queue filled before the workers started, a releaser that had stopped)
    # Then the key still sends its tasks back as early as it did: the trip is not learnt
    assert claim_after(60_000_000) == learnt
    # While a trip under SCRIPT_POLICY.learn_outlier_ms still is
    assert claim_after(SCRIPT_POLICY.learn_outlier_ms * 1000 - 1) != learnt


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_claim_a_little_early_is_granted_its_start_once_and_only_with_its_slack_inside_its_span(
    store: RedisStore, clock: FakeClock, algorithm: str
) -> None:
    # Given a key at its limit, and two starts reserved behind it: one open 5 ms, one
    # open 1 µs (shorter than the 2 ms a body may take to start)
    rates = rates_of(["2/s"])
    key = state_key(store.prefix, "early", algorithm)
    full = WindowCall(algorithm, rates, 1, slack_us=2000)
    while store.acquire(key, full).allowed:
        pass
    wide = store.acquire(key, WindowCall(algorithm, rates, 1, grace_us=5000, slack_us=2000), reserve=True)
    narrow = store.acquire(key, WindowCall(algorithm, rates, 1, grace_us=1, slack_us=2000), reserve=True)
    assert wide.code == narrow.code == Code.RESERVED
    # When each is claimed 10 ms before its start, by a worker that waits up to 20 ms here
    first = Reservation(wide.start_us, wide.latest_us, 1, wide.grace_us, wide.epoch)
    second = Reservation(narrow.start_us, narrow.latest_us, 1, narrow.grace_us, narrow.epoch)
    marker = f"{key}:claimed:t1:{first.start_us}"
    clock.now = first.start_us - 10_000
    granted = store.claim(key, full, first, marker=marker, early_us=20_000)
    # Then the first is granted its start (it waits 10 ms, then runs, with no second call)
    assert (granted.code, granted.wait_us, granted.start_us) == (Code.RUN_AT, 10_000, first.start_us)
    # and only once: its marker is set, a second claim of it is checked afresh
    clock.now = first.start_us
    assert store.claim(key, full, first, marker=marker, early_us=20_000).code not in (Code.RUN, Code.RUN_AT)
    # while the second, whose span cannot hold the slack, is told to wait for its start
    # (a fixed window's span runs to the window's end: it holds it)
    clock.now = second.start_us - 10_000
    assert store.claim(key, full, second, early_us=20_000).code == (Code.EARLY if algorithm == "sliding"
                                                                     else Code.RUN_AT)
    # and one further ahead than the worker waits is told so too
    clock.now = first.start_us - 30_000
    assert store.claim(key, full, first, early_us=20_000).code == Code.EARLY


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_admit_at_publish_records_nothing_for_a_key_with_room_and_reserves_near_the_limit(
    store: RedisStore, clock: FakeClock, algorithm: str
) -> None:
    # Given an empty "10/m" key
    rates = rates_of(["10/m"])
    key = state_key(store.prefix, "admit", algorithm)
    call = WindowCall(algorithm, rates, 2, grace_us=100_000)
    # When a call of cost 2 is admitted at publish
    first = store.admit(key, call)
    # Then it fits, nothing is recorded, and the room up to half the limit is 5 units
    assert (first.code, first.leased, first.start_us) == (Code.RUN, 5, 0)
    assert store.peek(key, call).remaining == 10
    # And once 4 units are counted, a call of 2 would pass half the limit: it is reserved
    for _ in range(2):
        assert store.acquire(key, call).allowed
    near = store.admit(key, call)
    assert near.code == Code.RESERVED and near.start_us == clock.now and near.latest_us > clock.now
    assert store.peek(key, call).remaining == 4


@pytest.mark.parametrize("seed", range(1 if QUICK else 2))
@pytest.mark.parametrize("rate_set", ["one", "three", "tiny-periods", "rpm-tpm"] if QUICK else
                         ["one", "two", "three", "wide", "tiny-periods", "requests-tokens", "rpm-tpm"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("overruns", [False, True], ids=["refunds", "refunds-and-overruns"])
def test_settled_costs_match_the_model(store: RedisStore, clock: FakeClock, algorithm: str, rate_set: str,
                                       seed: int, overruns: bool) -> None:
    """Calls that started report their real cost (celery_throttle.charge) at random moments
    of a random walk: script and model agree on every reply and the stored state. With
    refunds only, no window ever holds more than the limit of reported units; with
    overruns too, a window may (an overrun is known only when reported), and the model
    check alone holds."""
    stable_seed = zlib.crc32(f"settle/{algorithm}/{rate_set}/{seed}/{overruns}".encode())
    h = new_harness(store, clock, algorithm, RATE_SETS[rate_set], seed=stable_seed)
    rng, settled = h.rng, 0
    for _ in range(STEPS):
        if h.started and rng.random() < 0.3:
            index = rng.randrange(len(h.started))
            h.settle(index, h.random_report(h.started[index][0].units, overruns))
            settled += 1
        else:
            h.random_operation()
    if not overruns:
        h.check_invariant()
    assert settled > 10, "the walk settled too little: it tested nothing"
