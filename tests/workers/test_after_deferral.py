"""Capacity that appears after the tasks were turned away is used: a start is decided when
there is room, not fixed when the task was deferred.

Each test sends its backlog from a producer process that only imports the task module
and sends (admission at publish), to real workers; then changes what the key can take (an
operator raises or resets its limit, bodies report costs below or above their estimate,
a pool slower than the limit) and measures what the backlog does after.

The bounds asserted here are the behaviour's, with room for a loaded machine: the
figures against the fastest schedule each load allows are bench/after_deferral.py's (section
`deferral`), reported in the README.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

import celery_throttle
from celery_throttle.core.keys import line_index_key, state_key
from tests.helpers import (
    BROKER_URL,
    STORE_URL,
    WorkerGroup,
    assert_each_ran_once,
    max_started_in,
    new_label,
)
from tests.taskapp import app as tasks_app


@pytest.fixture
def operator(workers: WorkerGroup) -> Iterator[celery_throttle.Throttle]:
    """An operator's handle on the workers' store (as `celery -A proj throttle` is)."""
    ctl = celery_throttle.Throttle(tasks_app, {"redis_url": STORE_URL, "key_prefix": workers.prefix})
    yield ctl
    ctl.close()


def _where_the_line_stands(operator: celery_throttle.Throttle, scope: str, key: str) -> str:
    """The key's status and its place in the index of lines (when it is next looked at)."""
    state = state_key(operator.settings.key_prefix, scope, key)
    due = operator.store._redis.zscore(line_index_key(operator.settings.key_prefix), state)
    now = operator.store._redis.time()
    return (f"status: {operator.status(scope, key)!r}; index due: "
            f"{'none' if due is None else f'{(due - (now[0] * 1e6 + now[1])) / 1e6:+.1f}s'}")


def _times(starts: list[dict]) -> list[float]:
    return sorted(e["t"] for e in starts)


def test_a_limit_raised_mid_backlog_is_used_at_once(workers: WorkerGroup,
                                                    operator: celery_throttle.Throttle) -> None:
    # Given 60 tasks of a tenant under 6/m: 6 ran, 54 wait in the key's line
    label, tenant = new_label(), f"raise-{new_label()}"
    out = workers.produce({"how": "delay", "task": "raisable", "args": [label, tenant], "count": 60})
    workers.wait_starts(label, 6, timeout=30, settle=1.0)
    assert len(workers.starts(label)) == 6
    # When an operator raises the key to 600/m
    raised_at = time.time()
    operator.set_limit("raisable", ["600/m"], key=tenant)
    # Then the 54 start at once (a sliding 600/m has room for them all), not on the
    # starts they were given under 6/m (up to 9 minutes out), each once
    starts = workers.wait_starts(label, 60, timeout=30)
    assert_each_ran_once(starts, out["sent"][0])
    assert _times(starts)[-1] - raised_at < 6.0


def test_a_key_reset_and_raised_mid_backlog_runs_its_backlog(workers: WorkerGroup,
                                                             operator: celery_throttle.Throttle) -> None:
    # Given 30 tasks of a tenant under 6/m: 6 ran, 24 wait
    label, tenant = new_label(), f"reset-{new_label()}"
    out = workers.produce({"how": "delay", "task": "raisable", "args": [label, tenant], "count": 30})
    workers.wait_starts(label, 6, timeout=30, settle=1.0)
    # When an operator resets the key and raises it to 300/m
    reset_at = time.time()
    operator.reset("raisable", key=tenant)
    operator.set_limit("raisable", ["300/m"], key=tenant)
    # Then the other 24 start at once, each once
    try:
        starts = workers.wait_starts(label, 30, timeout=30)
    except AssertionError as exc:  # (seen once in a full run: say where the line stood)
        raise AssertionError(f"{exc}\n{_where_the_line_stands(operator, 'raisable', tenant)}") from None
    assert_each_ran_once(starts, out["sent"][0])
    assert _times(starts)[-1] - reset_at < 6.0


def test_refunds_from_charge_let_the_line_go_on_at_once(workers: WorkerGroup) -> None:
    # Given 30 calls of a tenant under 10/4s, each estimated at 5 units and reporting 1
    label, tenant = new_label(), f"refund-{new_label()}"
    sent_at = time.time()
    out = workers.produce({"how": "delay", "task": "refunded", "args": [label, tenant], "count": 30})
    # Then each refund lets the next call start: a call may start while its estimate
    # fits beside what was reported (at most 6 calls in a window: 5 reported units and
    # the next one's 5), so the 30 take 5 windows, about 16-20 s (57.9 s when each start
    # was fixed on the estimate as the task was turned away). Timed from the first start:
    # the producer's and the workers' start-up on a loaded machine is not the line's (35.8 s
    # from the send once, beside three CPU hogs).
    starts = workers.wait_starts(label, 30, timeout=60)
    assert_each_ran_once(starts, out["sent"][0])
    times = _times(starts)
    assert times[-1] - times[0] < 30.0, (times[0] - sent_at, times[-1] - times[0])
    # and the window held on what was reported (1 unit per call)
    assert max_started_in(times, 4.0) <= 10


def test_a_pool_slower_than_the_limit_loses_no_throughput(store_client: redis.Redis) -> None:
    # Given 2 pool processes, and 40 bodies of 1 s under 10/2s: the pool, not the limit,
    # sets the pace (2 a second)
    group = WorkerGroup(prefix=f"ct-test-{uuid.uuid4().hex[:10]}", broker=BROKER_URL, store=STORE_URL, count=1,
                        concurrency=2, env={"CT_PREFETCH": "1"})
    label, tenant = new_label(), f"slow-{new_label()}"
    try:
        group.start()
        sent_at = time.time()
        out = group.produce({"how": "delay", "task": "slow_body", "args": [label, tenant], "count": 40})
        # Then the 40 take about what the pool allows, 20 s: a start the pool could not
        # take in time is not sent to the back of the line (36.9 s when it was)
        starts = group.wait_starts(label, 40, timeout=60)
        assert_each_ran_once(starts, out["sent"][0])
        times = _times(starts)
        assert times[-1] + 1.0 - sent_at < 30.0
        assert max_started_in(times, 2.0) <= 10
        # and those counted at publish ran in the order they were sent, but for the two
        # processes' overlap (the first UNCHECKED, sent unchecked on the key's room, are
        # checked as new tasks where they arrive: behind the line, if one formed meanwhile)
        order = {task_id: n for n, task_id in enumerate(out["sent"][0])}
        ranks = [order[e["id"]] for e in sorted(starts, key=lambda e: e["t"]) if order[e["id"]] >= UNCHECKED]
        assert all(later >= earlier - 2 for earlier, later in itertools.pairwise(ranks)), ranks
    finally:
        group.stop()
        for key in store_client.scan_iter(match=f"{group.prefix}*", count=1000):
            store_client.delete(key)


def test_an_overrun_reported_by_charge_holds_back_the_starts_after_it(workers: WorkerGroup) -> None:
    # Given 12 calls of a tenant under 10/2s, each estimated at 1 unit and reporting 5
    # as it starts
    label, tenant = new_label(), f"overrun-{new_label()}"
    out = workers.produce({"how": "delay", "task": "overrunning", "args": [label, tenant], "count": 12})
    starts = workers.wait_starts(label, 12, timeout=60)
    assert_each_ran_once(starts, out["sent"][0])
    times = _times(starts)
    # Then the only excess is the overrun of the calls already running when it was
    # reported (the workers' 4 processes): no call starts while the units reported
    # before it (by calls started at least REPORTED_WITHIN earlier) fill the window
    for t in times:
        reported = 5 * sum(1 for s in times if t - 2.0 < s <= t - REPORTED_WITHIN)
        assert reported + 1 <= 10 or reported == 0, (t, reported, times)


#: The tasks a producer sends unchecked on an idle 10/2s key: up to half its limit.
UNCHECKED = 5

#: A body that started this long before another has surely reported its cost (it charges
#: right after it starts), on a loaded machine.
REPORTED_WITHIN = 0.5
