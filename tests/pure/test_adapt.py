"""Adaptive limits: the level's law (pure), and a model of a downstream whose limit is
unknown and moves, driven by that law and the lowering's once-per-window rule.

The model: a downstream that accepts at most ``D`` calls per window (``D`` changing now
and then); a client that offers, each window, as many calls as its level in force allows
(``floor(ceiling * level)``); each window with a refusal is a pushback (one per window, as
adapt.lua counts them). Whatever the downstream does, the level stays between the floor
and the ceiling; after the downstream's limit falls, the client is under it again within
a few pushbacks; while it holds still, pushbacks come no oftener than the law's dwell
allows (no bursts of refusals), and the client uses most of what the downstream allows.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import find, given, settings

from celery_throttle import Adapt, throttle
from celery_throttle.core.adapt import Pushback, adapt_of, level, pushed_level, refined_level, scaled_limit
from celery_throttle.core.errors import ConfigurationError
from tests.helpers import QUICK

WINDOW_US = 1_000_000
DEFAULT = Adapt()

adapts = st.builds(Adapt, floor=st.floats(0.01, 0.5), decrease=st.floats(0.3, 0.95),
                   growth=st.floats(0.0005, 0.05))


@settings(max_examples=100 if QUICK else 500, deadline=None)
@given(adapts, st.floats(0.01, 1.0), st.lists(st.integers(0, 200 * WINDOW_US), min_size=2, max_size=20))
def test_the_level_stays_between_floor_and_ceiling_starts_lowered_and_only_rises(
        adapt: Adapt, w_max: float, times: list[int]) -> None:
    # Given a pushback at level w_max at time 0
    pushed = Pushback(w_max, 0, "backoff")
    levels = [level(adapt, pushed, t, WINDOW_US) for t in sorted(times)]
    # Then the level is between the floor and the ceiling, never falls as time passes,
    # starts at the decrease of w_max (or the floor), and is back at w_max K windows on
    assert all(adapt.floor <= x <= 1.0 for x in levels)
    assert levels == sorted(levels)
    assert level(adapt, pushed, 0, WINDOW_US) == pytest.approx(max(adapt.floor, adapt.decrease * max(w_max, adapt.floor)))
    k = ((1 - adapt.decrease) / adapt.growth) ** (1 / 3)
    assert level(adapt, pushed, round(k * WINDOW_US), WINDOW_US) == pytest.approx(min(1.0, max(w_max, adapt.floor)),
                                                                                   abs=1e-6)
    assert level(adapt, None, 0, WINDOW_US) == 1.0


def test_a_limit_scaled_keeps_room_for_a_calls_own_units() -> None:
    assert scaled_limit(100, 0.35) == 35
    assert scaled_limit(100, 0.001) == 1
    assert scaled_limit(4000, 0.01, least=300) == 300
    assert scaled_limit(10, 1.0) == 10


def test_adapt_is_declared_as_true_a_value_or_a_dict_and_anything_else_fails_at_import() -> None:
    assert adapt_of(True) == Adapt() and adapt_of(None) is None and adapt_of(False) is None
    assert adapt_of({"floor": 0.2}) == Adapt(floor=0.2)
    for bad in ("yes", 1, {"flor": 0.2}, {"floor": 0}, {"decrease": 1.0}, {"growth": -1}, {"floor": float("nan")}):
        with pytest.raises(ConfigurationError):
            adapt_of(bad)
    with pytest.raises(ConfigurationError, match="give the throttle a rate"):
        throttle(concurrency=2, adapt=True)
    assert throttle("10/s", adapt=Adapt(floor=0.5)) is not None


def test_a_pushback_reads_back_as_written_and_nothing_else_is_one() -> None:
    pushed = Pushback(0.35, 1_796_000_000_000_000, "backoff")
    assert Pushback.read(pushed.value()) == Pushback(0.35, 1_796_000_000_000_000, "backoff")
    for bad in ("", "0.5", "x,1,backoff", "0,1,b", "1.5,1,b", "nan,1,b", "0.5,-1,b", "0.5,1.5,b"):
        with pytest.raises(ValueError):
            Pushback.read(bad)


# -- the model: a downstream whose limit moves ------------------------------------------
#: The share of a window's calls already started when the downstream refuses one (in
#: flight): window.lua lowers every worker's limit from its next check on, so only those
#: go on at the old level.
IN_FLIGHT = 0.1


@dataclass
class Client:
    """What adapt.lua and window.lua make of the law: the last pushback, and a pushback
    counted once per window."""

    adapt: Adapt
    ceiling: int
    pushback: Pushback | None = None
    pushbacks: list[int] = field(default_factory=list)
    refused_share: float = 0.0

    def allowed(self, now: int) -> int:
        return scaled_limit(self.ceiling, level(self.adapt, self.pushback, now, WINDOW_US))

    def refused(self, now: int, used: float = 1.0) -> None:
        if self.pushback is not None and now - self.pushback.at_us < WINDOW_US:
            # (adapt.lua: once per window; the others refine it)
            self.refused_share += 1 / self.ceiling
            refined = refined_level(self.adapt, self.pushback.w_max, used, self.refused_share)
            if refined is not None:
                self.pushback = self.pushback._replace(w_max=refined)
            return
        self.refused_share = 1 / self.ceiling
        in_force = level(self.adapt, self.pushback, now, WINDOW_US)
        before = level(self.adapt, self.pushback, now - WINDOW_US, WINDOW_US)
        self.pushback = Pushback(pushed_level(self.adapt, self.pushback, in_force, before, used), now, "backoff")
        self.pushbacks.append(now // WINDOW_US)


def run(adapt: Adapt, ceiling: int, phases: list[tuple[int, int]]) -> tuple[Client, list[tuple[int, int, int]]]:
    """(the client, each window's (downstream limit, accepted + refused, refused)): a window
    offered more than the downstream takes has the calls in flight refused, then the
    lowered limit holds."""
    return run_limits(adapt, ceiling, [limit for limit, length in phases for _ in range(length)])


def run_limits(adapt: Adapt, ceiling: int, limits: list[int]) -> tuple[Client, list[tuple[int, int, int]]]:
    """:func:`run` against a downstream whose limit is ``limits[i]`` in window i."""
    client, windows, now = Client(adapt, ceiling), [], 0
    for limit in limits:
        offered = client.allowed(now)
        refused = min(offered - limit, math.ceil(IN_FLIGHT * offered)) if offered > limit else 0
        for n in range(refused):  # (each refused call raises its Backoff, with the
            # downstream's and the calls in flight in the window)
            client.refused(now + n, (limit + math.ceil(IN_FLIGHT * offered)) / ceiling)
        windows.append((limit, min(offered, limit) + refused, refused))
        now += WINDOW_US
    return client, windows


#: Downstream limits the model walks: from the floor's share of the ceiling (10 of 100) up.
phases = st.lists(st.tuples(st.integers(10, 100), st.integers(30, 120)), min_size=1, max_size=4)


def broken(moves: list[tuple[int, int]], adapt: Adapt = DEFAULT, ceiling: int = 100) -> str | None:
    """The promise the law breaks against a downstream whose limit makes ``moves``, if any."""
    client, windows = run(adapt, ceiling, moves)
    if not all(math.floor(ceiling * adapt.floor) <= offered <= ceiling for _, offered, _ in windows):
        return "offered outside the floor and the ceiling"
    start, before = 0, ceiling
    for limit, length in moves:
        phase, first = windows[start:start + length], start
        start += length
        # A fall of the downstream's limit is caught within a few pushbacks, one a window;
        # a rise is found within the law's climb
        settled = next((i for i, (_, offered, _) in enumerate(phase) if offered <= limit), length)
        if settled > SETTLE:
            return f"still over {limit} after {settled} windows: {phase[:20]}"
        if limit > before and length > CLIMB and not any(o >= 0.8 * limit for _, o, _ in phase[:CLIMB]):
            return f"not at 80 % of {limit} after {CLIMB} windows: {phase[:CLIMB]}"
        before = limit
        # Once under it, no bursts: never a pushback in two windows in a row (from 20 units
        # a window: below, a unit is a step of the level of 5 % or more), a few refused
        # calls per hundred; and once it has climbed, most of what the downstream allows used
        later = [w - first for w in client.pushbacks if settled < w - first < length]
        if limit >= 20 and not all(b - a >= 2 for a, b in itertools.pairwise(later)):
            return f"pushbacks in a row: {later}"
        tail = phase[settled + 1:]
        if sum(offered for _, offered, _ in tail) >= 300:
            refused = sum(r for _, _, r in tail) / sum(offered for _, offered, _ in tail)
            if refused > 0.03:
                return f"{100 * refused:.1f} refused per 100 under {limit}"
        steady = phase[CLIMB:]
        if len(steady) >= 30:
            used = sum(offered - r for _, offered, r in steady) / sum(lim for lim, _, _ in steady)
            if used < 0.8:
                return f"{100 * used:.0f} % of {limit} used"
    return None


#: Windows a fall of the downstream's limit (to a tenth) takes to meet at most: the first
#: pushback's window counts what the downstream took of it (its starts less its refusals).
SETTLE = 3
#: Windows a climb of the level to a downstream's risen limit (up to 10 times) takes at
#: most under the default law: K (3.9) and cbrt(9 / 0.005) (12.2).
CLIMB = 17


@settings(max_examples=100 if QUICK else 400, deadline=None)
@given(phases)
def test_against_a_downstream_whose_limit_moves_the_default_law_refuses_little_and_uses_most_of_it(
        moves: list[tuple[int, int]]) -> None:
    # Given a downstream whose limit makes any moves between the floor and the ceiling
    # Then the promises hold: bounds, a fall met and a rise found within a few windows, no
    # bursts of refusals, most of the downstream used
    assert broken(moves) is None, broken(moves)


@pytest.mark.parametrize("mutation", ["no guard", "no dwell", "blind to the window"])
def test_the_model_catches_a_law_that_bursts_or_a_lowering_counted_per_refusal(
        mutation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the law or its guard broken
    adapt = Adapt()
    if mutation == "no guard":  # (every refused call lowers)
        def refused(self: Client, now: int, used: float = 1.0) -> None:
            in_force = level(self.adapt, self.pushback, now, WINDOW_US)
            before = level(self.adapt, self.pushback, now - WINDOW_US, WINDOW_US)
            self.pushback = Pushback(pushed_level(self.adapt, self.pushback, in_force, before, used), now, "backoff")
            self.pushbacks.append(now // WINDOW_US)
        monkeypatch.setattr(Client, "refused", refused)
    elif mutation == "no dwell":  # (a fast climb back: no dwell where it was refused)
        adapt = Adapt(growth=0.1)
    else:  # (a pushback that does not look at what the downstream took of its window:
        # the decreases alone, one a window, bring the level down)
        monkeypatch.setattr(sys.modules[__name__], "refined_level", lambda adapt, w_max, used, refused: None)
        real = pushed_level
        monkeypatch.setattr(sys.modules[__name__], "pushed_level",
                            lambda adapt, last, now, before, used=1.0: real(adapt, last, now, before))
    # Then the model finds a downstream against which a promise breaks
    found = find(phases, lambda moves: broken(moves, adapt) is not None,
                 settings=settings(max_examples=2000, deadline=None))
    assert broken(found, adapt) is not None


# -- other shapes: a slow drift, a limit shared with a client whose load changes ----------
def drift(start: int, end: int, windows: int) -> list[int]:
    """A limit moving evenly from ``start`` to ``end`` over ``windows`` windows."""
    return [round(start + (end - start) * i / (windows - 1)) for i in range(windows)]


def shared(limit: int, others: list[tuple[int, int]]) -> list[int]:
    """A limit of ``limit`` shared with another client, who takes ``load`` of it for
    ``length`` windows, phase by phase."""
    return [max(limit - load, 10) for load, length in others for _ in range(length)]


#: Drifts of at most 90 % of the ceiling over 60 windows or more (from 10/s to 100/s in a
#: minute, for a limit of 100/s), and a partner's load of up to 60 % of the limit.
drifts = st.builds(drift, st.integers(10, 100), st.integers(10, 100), st.integers(60, 300))
shares = st.builds(shared, st.integers(40, 100),
                   st.lists(st.tuples(st.integers(0, 60), st.integers(20, 120)), min_size=1, max_size=5))
#: Against a shape it did not see: at most this many refused per 100 calls, at least this
#: share of what the downstream allows used, after its first CLIMB windows.
SHAPE_REFUSED, SHAPE_USED = 0.025, 0.8


def unmet(limits: list[int], adapt: Adapt = DEFAULT, ceiling: int = 100) -> str | None:
    """The promise the law breaks against a downstream whose limit is ``limits``, window by
    window, counted over the whole run but for the windows the step promises cover (the
    first CLIMB, CLIMB after a jump up of the limit, SETTLE after a jump down: a jump is a
    tenth of the ceiling or more in one window; a slow drift has none)."""
    _, windows = run_limits(adapt, ceiling, limits)
    skip = set(range(CLIMB))
    for i in range(1, len(limits)):
        if abs(limits[i] - limits[i - 1]) >= ceiling // 10:
            skip.update(range(i, i + (CLIMB if limits[i] > limits[i - 1] else SETTLE)))
    tail = [w for i, w in enumerate(windows) if i not in skip]
    offered = sum(o for _, o, _ in tail)
    if len(tail) < 20 or offered < 300:  # (too few settled windows to judge a share by)
        return None
    refused = sum(r for _, _, r in tail) / offered
    used = sum(o - r for _, o, r in tail) / sum(lim for lim, _, _ in tail)
    if refused > SHAPE_REFUSED:
        return f"{100 * refused:.1f} refused per 100"
    if used < SHAPE_USED:
        return f"{100 * used:.0f} % of the downstream used"
    return None


@settings(max_examples=100 if QUICK else 400, deadline=None)
@given(st.one_of(drifts, shares))
def test_against_a_drifting_or_shared_downstream_the_default_law_refuses_little_and_uses_most_of_it(
        limits: list[int]) -> None:
    # Given a downstream whose limit drifts slowly, or is shared with a client whose load
    # changes (shapes the law was not tuned on)
    # Then it refuses little and uses most of what the downstream allows
    assert unmet(limits) is None, unmet(limits)


@pytest.mark.parametrize("mutation", ["no dwell", "steep decrease"])
def test_the_shapes_catch_a_law_that_overshoots_or_gives_up_too_much(mutation: str) -> None:
    adapt = Adapt(growth=0.1) if mutation == "no dwell" else Adapt(decrease=0.2)
    found = find(st.one_of(drifts, shares), lambda limits: unmet(limits, adapt) is not None,
                 settings=settings(max_examples=2000, deadline=None))
    assert unmet(found, adapt) is not None
