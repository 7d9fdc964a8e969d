"""``throttle simulate``'s replay (celery_throttle/ops/simulate.py): a record's tasks, key by
key, through a model of their line under the recorded or proposed limits. Pure: events in,
waits out (the record on real workers: tests/workers/test_cli.py)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_throttle.core.rates import parse_rate
from celery_throttle.ops.simulate import Proposal, replay, tasks_of, waits
from tests.reference import max_units_in_any_interval, max_units_per_aligned_window

S = 1_000_000


def arrival(i: int, t: float, rate: str = "2/s", key: str | None = "acme", urgency: int = 0, cost: int = 1,
            concurrency: int = 0, algorithm: str = "sliding", scope: str = "api") -> str:
    return json.dumps({"k": "a", "id": f"t{i}", "t": int(t * S), "s": scope, "key": key, "c": cost, "u": urgency,
                       "r": rate, "a": algorithm, "n": concurrency})


def start(i: int, t: float) -> str:
    return json.dumps({"k": "s", "id": f"t{i}", "t": int(t * S)})


def end(i: int, t: float) -> str:
    return json.dumps({"k": "e", "id": f"t{i}", "t": int(t * S)})


def would(events: list[str], proposal: Proposal | None = None) -> list[float | None]:
    tasks, _ = tasks_of(events)
    (outcome,) = replay(tasks, proposal or Proposal())
    return [None if w is None else round(w / S, 3) for w in outcome.would]


def test_a_burst_waits_a_window_per_limit_and_a_raised_limit_shortens_it() -> None:
    # Given 10 tasks that came at once to a key of 2/s (and started a window per 2 apart)
    events = [arrival(i, 100.0) for i in range(10)] + [start(i, 100.0 + i // 2) for i in range(10)]
    # Then replayed as recorded they would have waited as they did
    assert would(events) == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]
    tasks, _ = tasks_of(events)
    assert [w / S for w in replay(tasks, Proposal())[0].did] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]
    # and under 5/s, for the scope or its key, a window at most
    assert would(events, Proposal.parse(["api=5/s"])) == [0.0] * 5 + [1.0] * 5
    assert would(events, Proposal.parse(["api:acme=10/s"])) == [0.0] * 10
    # and another key's proposal changes nothing here
    assert would(events, Proposal.parse(["api:globex=10/s"])) == would(events)


def test_an_urgent_task_goes_ahead_unless_replayed_first_come_first_served() -> None:
    events = [arrival(i, 0.0) for i in range(6)] + [arrival(6, 0.5, urgency=5)]
    assert would(events)[6] == 0.5  # (it came at 0.5 and went at 1.0, before the 4 waiting)
    assert would(events, Proposal(fifo=True))[6] == 2.5


def test_a_concurrency_limit_replays_each_body_as_long_as_it_ran() -> None:
    events = [arrival(i, 0.0, rate="", concurrency=1) for i in range(3)]
    events += [start(0, 0.0), end(0, 1.5), start(1, 1.5), end(1, 2.0), start(2, 2.0), end(2, 4.0)]
    assert would(events) == [0.0, 1.5, 2.0]
    assert would(events, Proposal.parse(concurrency=["api=2"])) == [0.0, 0.0, 0.5]  # (t1 ran 0.5 s)


def test_a_fixed_window_replays_aligned_and_a_cost_that_never_fits_is_said() -> None:
    events = [arrival(i, 0.9, rate="2/s", algorithm="fixed") for i in range(4)]
    assert would(events) == [0.0, 0.0, 0.1, 0.1]
    big = [arrival(0, 0.0, cost=3)]
    assert would(big) == [None]
    assert waits([None, 2 * S, S]) == {"p50": 2.0, "p95": 2.0, "max": 2.0, "unknown": 1}


def test_events_of_tasks_that_arrived_before_the_span_are_counted_apart() -> None:
    tasks, orphans = tasks_of([start(7, 1.0), end(7, 2.0), arrival(1, 1.0), start(1, 1.0)])
    assert [t.id for t in tasks] == ["t1"] and orphans == 2


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 20), st.integers(-2, 2), st.integers(1, 3)), min_size=1, max_size=60),
       st.sampled_from(["3/s", "5/2s", "4/s"]), st.sampled_from(["sliding", "fixed"]), st.booleans())
def test_a_replay_never_fills_a_window_past_its_limit_and_starts_nothing_before_it_came(
        arrivals: list[tuple[float, int, int]], rate: str, algorithm: str, fifo: bool) -> None:
    events = [arrival(i, t, rate=rate, urgency=u, cost=c, algorithm=algorithm) for i, (t, u, c) in enumerate(arrivals)]
    tasks, _ = tasks_of(events)
    (outcome,) = replay(tasks, Proposal(fifo=fifo))
    starts = [(t.arrive + w, t.units(outcome.rates)[0]) for t, w in zip(tasks, outcome.would) if w is not None]
    assert all(w is None or w >= 0 for w in outcome.would)
    r = parse_rate(rate)
    most = (max_units_in_any_interval(starts, r.period_us) if algorithm == "sliding"
            else max_units_per_aligned_window(starts, r.period_us))
    assert most <= r.limit
    if fifo:  # (first come first served: starts in the order they came)
        ordered = [t.arrive + w for t, w in zip(tasks, outcome.would) if w is not None]
        assert ordered == sorted(ordered)


def shared(i: int, t: float, key: str, weight: float, seconds: float, most: int = 0) -> list[str]:
    """A task of a scope of K=2 its keys share, that ran ``seconds``."""
    event = json.loads(arrival(i, t, rate="", key=key, concurrency=2, scope="shared"))
    event.update(w=weight, m=most, task="tasks.export")
    return [json.dumps(event), start(i, t), end(i, t + seconds)]


def test_a_shared_k_goes_to_the_key_owed_most_and_a_proposed_weight_moves_it() -> None:
    # Given a flood of one key (8 bodies of 1 s) and, a little after, 2 tasks of another,
    # in a scope of K=2 its keys share by weight
    events = [e for i in range(8) for e in shared(i, 0.0, "big", 1.0, 1.0)]
    events += [e for i in (8, 9) for e in shared(i, 0.1, "small", 1.0, 1.0)]
    tasks, _ = tasks_of(events)

    def small_waits(proposal: Proposal) -> list[float]:
        outcome = next(o for o in replay(tasks, proposal) if o.key == "small")
        return [round(w / S, 3) for w in outcome.would if w is not None]

    # Then the small key gets one of the two slots that free first, and one more a body
    # later (one each: equal weights)
    assert small_waits(Proposal()) == [0.9, 1.9]
    # and with 3 times the flood's weight, both of the first slots that free
    assert small_waits(Proposal.parse(weights=["shared:small=3"])) == [0.9, 0.9]
    # and with K=4, it starts when the first bodies end all the same (4 of the flood ran)
    assert small_waits(Proposal.parse(concurrency=["shared=4"])) == [0.9, 0.9]


def test_a_proposed_priority_names_the_tasks_it_moves() -> None:
    events = [arrival(i, 0.0) for i in range(6)]
    reset = json.loads(arrival(6, 0.5))
    reset["task"] = "tasks.reset"
    events.append(json.dumps(reset))
    assert would(events)[6] == 2.5
    assert would(events, Proposal.parse(priorities=["tasks.reset=3"]))[6] == 0.5


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.sampled_from(["a", "b", "c"]), st.floats(0, 3)), min_size=1,
                max_size=40), st.integers(1, 4), st.integers(0, 2))
def test_a_shared_replay_never_runs_more_than_k_nor_a_key_past_its_most(
        arrivals: list[tuple[float, str, float]], slots: int, most: int) -> None:
    events = [e for i, (t, key, seconds) in enumerate(arrivals)
              for e in shared(i, t, key, {"a": 1.0, "b": 2.0, "c": 0.5}[key], seconds, most)]
    tasks, _ = tasks_of(events)
    outcomes = replay(tasks, Proposal.parse(concurrency=[f"shared={slots}"]))
    bodies = []  # (start, end, key)
    for outcome in outcomes:
        own = [t for t in tasks if t.key == outcome.key]
        for task, wait in zip(own, outcome.would):
            assert wait is not None and wait >= 0
            bodies.append((task.arrive + wait, task.arrive + wait + task.duration, task.key))
    for at, _, _ in bodies:
        running = [b for b in bodies if b[0] <= at < b[1]]
        assert len(running) <= slots
        if most:
            assert all(sum(1 for b in running if b[2] == key) <= most for key in "abc")


def test_a_record_across_a_deploy_of_share_replays_its_scope_whole_and_bad_proposals_are_refused() -> None:
    import pytest

    events = shared(0, 0.0, "a", 1.0, 1.0) + [arrival(1, 0.0, rate="", key="b", concurrency=2, scope="shared")]
    tasks, _ = tasks_of(events)
    assert [o.key for o in replay(tasks, Proposal())] == ["a", "b"]
    for bad in (["shared=0"], ["shared=-1"]):
        with pytest.raises(ValueError, match="at least 1"):
            Proposal.parse(concurrency=bad)
    with pytest.raises(ValueError, match="more than 0"):
        Proposal.parse(weights=["shared:a=0"])
