"""Behaviour of throttled tasks under real worker processes (2 workers x 2 processes).

Every test bursts tasks well over their limit and reads back when each body started
(the worker's clock), so the limits are checked on what really ran.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest
import redis
from celery.result import AsyncResult

from celery_throttle.core.keys import state_key
from tests.helpers import (
    RedisServer,
    WorkerGroup,
    assert_each_ran_once,
    max_in_window,
    max_started_in,
    max_started_in_aligned,
    new_label,
    wait_for,
)


@pytest.mark.any_store
def test_sliding_limit_holds_across_every_worker_process(workers: WorkerGroup) -> None:
    # Given a 5/s sliding limit (decorator below @app.task) and 4 pool processes
    label = new_label()
    # When 30 tasks are sent at once
    ids = [workers.send("below", label) for _ in range(30)]
    starts = workers.wait_starts(label, 30, timeout=30)
    # Then each ran exactly once and never more than 5 started in any 1 s
    # (how close to the ideal pace it ran is measured in bench/, not asserted here)
    assert_each_ran_once(starts, ids)
    times = sorted(e["t"] for e in starts)
    assert max_started_in(times, 1.0) <= 5
    assert len({e["pid"] for e in starts}) >= 2, "the burst should be spread over processes"


def _script_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.mark.parametrize("task", ["busy", "busy_tokens"], ids=["one unit", "requests and tokens"])
def test_busy_key_far_below_its_limit_is_admitted_from_leases_and_still_held(
    broker_url: str, store_client: redis.Redis, task: str
) -> None:
    # Given 4 pool processes, whose store is a Redis of this test's own (its script calls
    # are counted there: tests running beside it on the shared one would be counted too)
    server = RedisServer().start()
    workers = WorkerGroup(prefix=f"ct-test-{uuid.uuid4().hex[:10]}", broker=broker_url, store=server.url,
                          count=2, concurrency=2)
    try:
        workers.start()
        label = new_label()
        # When 120 tasks are sent at once to a key of 1500/10s (8% of its limit)
        counted = redis.Redis(port=server.port)
        before = _script_calls(counted)
        ids = [workers.send(task.replace("busy", "busy_long"), label) for _ in range(120)]
        starts = workers.wait_starts(label, 120, timeout=30, settle=0.2)
        # Then each ran once, and the pool took most starts from leases: fewer script calls
        # than tasks (without leases every start is one, plus the consumer's screening).
        # (A lease of a 10 s window lasts 1 s: a process asks for one at two calls a second,
        # which the pool does on a machine as loaded as it gets; one of 1 s windows lasts
        # 250 ms, and a pool slowed to 125 ms a task asks for none.)
        assert_each_ran_once(starts, ids)
        assert _script_calls(counted) - before < 120
        counted.close()
        # And when 120 and then 700 more follow at once to a key of 300/s (the 700 far past
        # it), no 1 s ever holds more than 300 starts (leases stop at half the limit; every
        # start is then checked alone)
        ids = [workers.send(task, f"{label}-300") for _ in range(120)]
        starts = workers.wait_starts(f"{label}-300", 120, timeout=30, settle=0.2)
        more = f"{label}-more"
        ids += [workers.send(task, more) for _ in range(700)]
        burst = workers.wait_starts(more, 700, timeout=60)
        assert_each_ran_once(starts + burst, ids)
        # (Starts as the bodies record them, which lag their checks: max_started_in measures
        # BODY_NOISE short of the window; 301 in 1.0 s of body times was seen once in a loaded
        # clean-shell run.)
        assert max_started_in(sorted(e["t"] for e in starts + burst), 1.0) <= 300
    finally:
        workers.stop()
        server.stop()
        for key in store_client.scan_iter(match=f"{workers.prefix}*", count=1000):
            store_client.delete(key)


@pytest.mark.any_store
def test_fixed_window_per_tenant_above_the_task_decorator(workers: WorkerGroup) -> None:
    # Given a fixed 4/s per tenant limit, declared above @app.task
    label = new_label()
    ids = [workers.send("above", label, tenant) for tenant in ("acme", "globex") for _ in range(12)]
    starts = workers.wait_starts(label, 24, timeout=30)
    assert_each_ran_once(starts, ids)
    # Then each tenant gets its own 4 per aligned second; tenants do not share
    for tenant in ("acme", "globex"):
        times = [e["t"] for e in starts if e["tenant"] == tenant]
        assert max_started_in_aligned(times, 1.0) <= 4
    first = min(e["t"] for e in starts)
    assert sum(1 for e in starts if e["t"] - first < 0.5) >= 5, "tenants should run side by side"


@pytest.mark.any_store
def test_shared_scope_two_rates_and_cost(workers: WorkerGroup) -> None:
    # Given two tasks sharing scope "shared-api" at 6/s and 9/3s, one costing len(ids)
    label = new_label()
    ids = [workers.send("sync_issues", label, list(range(n))) for n in (1, 2, 3, 1, 2, 1)]
    ids += [workers.send("other_user_of_api", label) for _ in range(6)]
    starts = workers.wait_starts(label, 12, timeout=40)
    assert_each_ran_once(starts, ids)
    times = [e["t"] for e in starts]
    weights = [e.get("ids", 1) for e in starts]
    # Then the units of both tasks together respect both rates
    assert max_started_in(times, 1.0, weights) <= 6
    assert max_started_in(times, 3.0, weights) <= 9


def test_a_call_costing_more_than_its_rate_fails_with_the_rate_and_does_not_run(workers: WorkerGroup) -> None:
    # Given sync_issues at 6/s costing len(ids): a call of 7 ids can never fit. Publish,
    # the consumer's screen and the pool's hook each get the store's verdict (refused:
    # the cost is checked once, by the script, under the limits in force); publish and
    # the screen hand it on, the hook fails it, naming the rate
    label = new_label()
    too_costly = workers.send("sync_issues", label, list(range(7)))
    fits = workers.send("sync_issues", label, list(range(6)))
    workers.wait_starts(label, 1, timeout=30)
    result = AsyncResult(too_costly, app=workers.client)
    wait_for(lambda: result.state == "FAILURE", timeout=30, what="the refused task to fail")
    assert "cost 7 of scope 'shared-api' exceeds the limit of its rate 6/s" in str(result.result), result.result
    assert [e["id"] for e in workers.starts(label)] == [fits]


@pytest.mark.any_store
def test_callable_rate_gives_each_plan_its_limit(workers: WorkerGroup) -> None:
    label = new_label()
    free, pro = f"free-{label}", f"pro-{label}"
    ids = [workers.send("planned", label, free, "free") for _ in range(6)]
    ids += [workers.send("planned", label, pro, "pro") for _ in range(12)]
    starts = workers.wait_starts(label, 18, timeout=30)
    assert_each_ran_once(starts, ids)
    assert max_started_in([e["t"] for e in starts if e["tenant"] == free], 1.0) <= 2
    pro_times = [e["t"] for e in starts if e["tenant"] == pro]
    assert max_started_in(pro_times, 1.0) <= 6
    assert max_in_window(pro_times, 1.0) > 2, "the pro plan should not be held to the free limit"


def test_denied_task_does_not_spend_retry_budget(workers: WorkerGroup) -> None:
    # Given a task with max_retries=0 limited to 3/s
    label = new_label()
    ids = [workers.send("no_retries", label) for _ in range(9)]
    starts = workers.wait_starts(label, 9, timeout=30)
    # Then every one ran, succeeded, and saw request.retries == 0
    assert_each_ran_once(starts, ids)
    assert all(e["retries"] == 0 for e in starts)
    for task_id in ids:
        assert AsyncResult(task_id, app=workers.client).get(timeout=10) is None
    # And each denied one was re-sent about once, not once per window
    denials = [d for d in workers.denials() if d["id"] in ids]
    assert len(denials) <= 6 + 2


def test_own_retries_still_count_and_work(workers: WorkerGroup) -> None:
    label = new_label()
    ids = [workers.send("retries_itself", label, 1) for _ in range(6)]
    starts = workers.wait_starts(label, 12, timeout=30)
    # Each task ran twice (first try, then its own retry), with retries 0 then 1
    per_task = {i: sorted(e["retries"] for e in starts if e["id"] == i) for i in ids}
    assert all(r == [0, 1] for r in per_task.values()), per_task
    assert max_started_in([e["t"] for e in starts], 1.0) <= 3
    # And a retry does not carry the reservation its first try used (it is a new call)
    for i in ids:
        first, retry = sorted((e for e in starts if e["id"] == i), key=lambda e: e["retries"])
        assert retry["reservation"] is None or retry["reservation"] != first["reservation"], (first, retry)


@pytest.mark.any_store
def test_denied_task_keeps_its_id_args_queue_and_properties(workers: WorkerGroup) -> None:
    # Given tasks sent to a second queue with a message property, well over a 5/s limit
    label = new_label()
    alt = f"{workers.queue}-alt"
    ids = [workers.send("below", label, queue=alt, app_id="billing") for _ in range(12)]
    starts = workers.wait_starts(label, 12, timeout=30)
    assert_each_ran_once(starts, ids)
    # Then the deferred ones came back on the queue they were sent to, with the property
    assert {e["queue"] for e in starts} == {alt}
    assert {e["app_id"] for e in starts} == {"billing"}
    throttled = {d["id"] for d in workers.denials()}
    assert len(throttled & set(ids)) >= 6


def test_signal_reports_each_denial_with_scope_key_and_delay(workers: WorkerGroup) -> None:
    label = new_label()
    tenant = f"sig-{label}"
    # (12 at a fixed 4/s: 8 fit at most if the first pass over them crosses a window's
    # edge, so 4 are denied at least; with 8, a pass across the edge could deny none.)
    ids = [workers.send("above", label, tenant) for _ in range(12)]
    workers.wait_starts(label, 12, timeout=30)
    denials = [d for d in workers.denials() if d["id"] in ids]
    assert len(denials) >= 4
    assert all(d["scope"] == "tests.taskapp.above" and d["key"] == tenant for d in denials)
    assert all(0 <= d["delay"] <= 2.5 for d in denials)


def test_rules_throttle_tasks_we_do_not_own(workers: WorkerGroup) -> None:
    label = new_label()
    ids = [workers.send("unowned_export", label, t) for t in ("a", "b") for _ in range(10)]
    ids += [workers.send("unowned_fixed", label) for _ in range(9)]
    starts = workers.wait_starts(label, 29, timeout=30)
    assert_each_ran_once(starts, ids)
    for tenant in ("a", "b"):
        assert max_started_in([e["t"] for e in starts if e.get("tenant") == tenant], 1.0) <= 4
    fixed = [e["t"] for e in starts if "tenant" not in e]
    assert max_started_in_aligned(fixed, 1.0) <= 3


def test_unthrottled_tasks_are_untouched(workers: WorkerGroup) -> None:
    label = new_label()
    ids = [workers.send("unthrottled", label) for _ in range(20)]
    starts = workers.wait_starts(label, 20, timeout=20, settle=0.3)
    assert_each_ran_once(starts, ids)
    times = sorted(e["t"] for e in starts)
    assert times[-1] - times[0] < 3
    assert not [d for d in workers.denials() if d["id"] in ids]


@pytest.mark.any_store
def test_tasks_that_must_wait_wait_in_their_keys_line_and_each_runs_once(workers: WorkerGroup) -> None:
    # Given a 3/4s quota
    label = new_label()
    tenant = f"park-{label}"
    ids = [workers.send("slow_quota", label, tenant, app_id="billing") for _ in range(9)]
    # When the quota is spent, those that wait do so in their key's line in the store
    # (with either broker), not as ETAs in a worker's memory
    line = f"{state_key(workers.prefix, 'tests.taskapp.slow_quota', tenant)}:line"
    wait_for(lambda: workers.store_client.zcard(line) >= 3, 10, what="tasks waiting in the line")
    starts = workers.wait_starts(label, 9, timeout=30)
    # Then all ran once, the limit held, and nothing is left in the line
    assert_each_ran_once(starts, ids)
    assert max_started_in([e["t"] for e in starts], 4.0) <= 3
    assert {e["app_id"] for e in starts} == {"billing"}  # sent with its message's properties
    assert any(d["id"] in ids for d in workers.denials())
    wait_for(lambda: not workers.store_client.exists(line, f"{line[:-len(':line')]}:msgs"), 10, what="an empty line")


def test_bad_key_argument_fails_visibly_and_is_not_dropped(workers: WorkerGroup) -> None:
    label = new_label()
    good = workers.send("keyed", label, "t1")
    bad = workers.send("keyed", label, None)
    assert AsyncResult(good, app=workers.client).get(timeout=15) is None
    result = AsyncResult(bad, app=workers.client)
    wait_for(lambda: result.state == "FAILURE", 15, what="the bad task to fail")
    message = str(result.result)
    assert "tests.taskapp.keyed" in message and "'tenant'" in message
    assert [e["tenant"] for e in workers.starts(label)] == ["'t1'"]


@pytest.mark.any_store
def test_window_state_lives_on_redis_with_ttl(workers: WorkerGroup) -> None:
    label = new_label()
    workers.send("above", label, f"ttl-{label}")
    workers.wait_starts(label, 1, timeout=15, settle=0.1)
    key = f"{workers.prefix}:{{tests.taskapp.above:ttl-{label}}}"
    ttl = workers.store_client.pttl(key)
    # the rest of the 1 s window, + 1 s margin, + 1 s of headroom (the shortest window)
    assert 0 < ttl <= 3000
    time.sleep(ttl / 1000 + 0.2)
    assert not workers.store_client.exists(key)


def test_a_denial_is_not_an_execution_for_celery_signals(workers: WorkerGroup) -> None:
    # Given tasks sent with a countdown (the consumer does not screen them: each denial
    # is made in the pool, where Celery's trace and its signals live)
    label = new_label()
    ids = [workers.send("signalled", label, countdown=0.2) for _ in range(15)]
    starts = workers.wait_starts(label, 15, timeout=30)
    assert_each_ran_once(starts, ids)
    denied = {d["id"] for d in workers.denials()} & set(ids)
    assert len(denied) >= 5, "a burst of 15 at 5/s is denied in the pool"
    # Then task_prerun and task_postrun fired exactly once per task: for its real run
    for signal in ("prerun", "postrun"):
        counts = Counter(n["id"] for n in workers.notes(signal) if n["id"] in set(ids))
        assert sorted(counts) == sorted(ids), f"task_{signal} missed a run"
        assert max(counts.values()) == 1, f"task_{signal} fired for a denial: {counts.most_common(3)}"
    assert {n["state"] for n in workers.notes("postrun") if n["id"] in set(ids)} == {"SUCCESS"}


def test_a_margin_keeps_any_n_starts_a_window_plus_the_margin_apart(workers: WorkerGroup) -> None:
    # Given @throttle("5/s", margin=0.2): any 6 starts at least 1.2 s apart
    label = new_label()
    ids = [workers.send("margined", label) for _ in range(16)]
    starts = workers.wait_starts(label, 16, timeout=30)
    assert_each_ran_once(starts, ids)
    times = sorted(e["t"] for e in starts)
    assert max_started_in(times, 1.2) <= 5
    # and no slower than the margin asks: 16 starts = 3 full windows of 1.2 s and a bit
    assert times[-1] - times[0] < 3 * 1.2 + 1.5
