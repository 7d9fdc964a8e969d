"""Folding a deep backlog changes no decision, for calls of one cost.

A rate of a key with thousands of starts ahead folds the front of its state (sliding: the
buckets followed by at least ``limit`` units, into the last of them; fixed: the windows
far ahead, into one range counted as full), so that its state and a check stay small
(docs/design.md, "Windows"). The claim is that this is exact, not merely safe, while every
call costs the same and nothing is given back: each start is where an unfolded state
would have put it. The scripts are held to ``tests.reference`` by the model checks; this
holds the reference's folding to the same reference with folding switched off.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_throttle.core.state import StateLayout
from tests.reference import FixedRate, SlidingRate

SEC = 1_000_000
BASE = 1_700_000_000 * SEC
#: A layout that keeps more buckets than any walk here opens, so that a sliding rate
#: folds only what cannot decide anything (the cap of buckets, a known limit, is not the
#: claim), and one of few buckets per window (wide buckets).
LAYOUTS = (StateLayout(max_buckets=10_000), StateLayout(buckets=4, max_buckets=10_000, max_ahead=3, keep_ahead=1))

# A walk: (time that passes before them, µs; how many calls come then) per step.
walks = st.lists(st.tuples(st.integers(0, 3 * SEC), st.integers(0, 60)), min_size=1, max_size=30)


def _rate(algorithm: str, limit: int, period: int, layout: StateLayout) -> SlidingRate | FixedRate:
    return (SlidingRate if algorithm == "sliding" else FixedRate)(limit, period, layout)


def _diverges(algorithm: str, limit: int, period: int, cost: int, walk: list[tuple[int, int]],
              layout: StateLayout, folded_rate: SlidingRate | FixedRate | None = None) -> str | None:
    """Where the folded rate first starts a call elsewhere than the unfolded one (None: never)."""
    folded = folded_rate or _rate(algorithm, limit, period, layout)
    exact = _rate(algorithm, limit, period, layout)
    slack = max(period // 100, 1000)
    now = BASE
    for step, (passes, calls) in enumerate(walk):
        now += passes
        for rate in (folded, exact):
            rate.load(now)
        for call in range(calls):
            x, y = folded.earliest(now, cost, slack), exact.earliest(now, cost, slack)
            if x != y:
                return f"step {step}, call {call}: folded {x - now} µs from now, unfolded {y - now}"
            for rate in (folded, exact):
                rate.record(x, x + slack, cost)
            folded.fold(now)  # (the script folds each time it writes a rate)
    return None


@settings(max_examples=300, deadline=None)
@given(algorithm=st.sampled_from(["sliding", "fixed"]), limit=st.integers(1, 12),
       period=st.sampled_from([SEC, 10 * SEC]), cost=st.integers(1, 3), walk=walks,
       layout=st.sampled_from(LAYOUTS))
def test_folding_a_deep_backlog_changes_no_decision_for_calls_of_one_cost(
        algorithm: str, limit: int, period: int, cost: int, walk: list[tuple[int, int]], layout: StateLayout) -> None:
    cost = min(cost, limit)
    assert _diverges(algorithm, limit, period, cost, walk, layout) is None


class _FoldsOneTooMany(SlidingRate):
    """A fold that also folds a bucket followed by one unit fewer than the limit (the
    reference folds one followed by a bucket and then at least the limit)."""

    def fold(self, now: int) -> None:
        keys = sorted(self.buckets)
        after = sum(self.buckets[k].units for k in keys[1:])
        i = 0
        while i + 1 < len(keys) and after >= self.limit - 1:
            front, behind = self.buckets.pop(keys[i]), self.buckets[keys[i + 1]]
            behind.units += front.units
            i += 1
            after -= behind.units - front.units


class _FoldsTheLastWindowsToo(FixedRate):
    """A fold that counts every window ahead as full, the last ones included."""

    def fold(self, now: int) -> None:
        ahead = sorted(k for k in self.windows if k > self.current)
        if len(ahead) <= self.layout.max_ahead:
            return
        for k in ahead:
            del self.windows[k]
        self.full = (min(ahead[0], self.full[0]) if self.full else ahead[0], ahead[-1])


def test_the_check_catches_a_fold_that_folds_too_much() -> None:
    rng = random.Random(7)
    layout = LAYOUTS[0]
    for algorithm, mutant in (("sliding", _FoldsOneTooMany), ("fixed", _FoldsTheLastWindowsToo)):
        found = None
        for _ in range(300):
            limit, period = rng.randint(2, 8), SEC
            walk = [(rng.randint(0, 2 * SEC), rng.randint(0, 40)) for _ in range(rng.randint(1, 12))]
            found = _diverges(algorithm, limit, period, 1, walk, layout, mutant(limit, period, layout))
            if found:
                break
        assert found, f"no walk told the {algorithm} mutant from the exact state"
