"""``max_wait``: a task whose start would be too far away fails visibly instead of waiting."""

from __future__ import annotations

import json
import uuid

import pytest
from celery.result import AsyncResult

from celery_throttle import WaitTooLong, throttle
from celery_throttle.core.config import Settings
from celery_throttle.core.errors import ConfigurationError
from celery_throttle.core.keys import state_key
from celery_throttle.core.spec import ThrottleSpec
from celery_throttle.core.timing import default_margin_us
from tests.helpers import WorkerGroup, wait_for
from tests.reference import SlidingRate


@pytest.mark.any_store
def test_a_task_that_would_wait_past_its_max_wait_fails_naming_scope_key_and_wait(
    workers: WorkerGroup,
) -> None:
    # Given a 2/m quota per tenant whose tasks wait at most 5 s
    label, tenant = uuid.uuid4().hex[:10], f"cap-{uuid.uuid4().hex[:8]}"
    # When 4 tasks of one tenant are sent at once
    ids = [workers.send("capped", label, tenant) for _ in range(4)]
    # Then 2 ran, and the other 2 (a minute away) failed with WaitTooLong at once
    starts = workers.wait_starts(label, 2, timeout=20)
    assert len(starts) == 2
    results = [AsyncResult(i, app=workers.client) for i in ids]
    wait_for(lambda: sum(r.state == "FAILURE" for r in results) == 2, 20, what="2 failures")
    failed = [r for r in results if r.state == "FAILURE"]
    for result in failed:
        assert isinstance(result.result, WaitTooLong), result.result
        message = str(result.result)
        assert "tests.taskapp.capped" in message and repr(tenant) in message and "max_wait of 5.0s" in message
    # And each was reported by the task_wait_exceeded signal with the wait it would have had
    gave_up = [json.loads(x) for x in workers.records.lrange(f"{workers.prefix}:gave-up", 0, -1)]
    mine = [g for g in gave_up if g["key"] == tenant]
    assert sorted(g["id"] for g in mine) == sorted(r.id for r in failed)
    assert all(g["wait"] > 5 and g["max_wait"] == 5 for g in mine)
    # And nothing was reserved for them: the window holds only the 2 that ran
    window_us = 60_000_000 + default_margin_us(60_000_000)  # (2/m, with the default margin)
    state = workers.store_client.hget(state_key(workers.prefix, "tests.taskapp.capped", tenant), f"s2/{window_us}")
    assert sum(SlidingRate.decode(state)[1::2]) == 2
    for result in results:
        result.forget()


def test_a_task_that_waited_for_a_slot_past_its_max_wait_fails_when_it_gets_one(workers: WorkerGroup) -> None:
    # Given one slot per tenant, whose tasks wait 2 s for it at most, held for 5 s
    label, tenant = uuid.uuid4().hex[:10], f"slot-{uuid.uuid4().hex[:8]}"
    workers.send("capped_slot", f"{label}-holder", tenant, 5.0)
    wait_for(lambda: workers.records.llen(f"{workers.prefix}:began") and any(
        json.loads(x)["label"] == f"{label}-holder" for x in workers.records.lrange(f"{workers.prefix}:began", 0, -1)),
        15, what="the holder's start")
    # When a second task of the tenant waits for the slot
    waiter = workers.send("capped_slot", label, tenant)
    # Then, handed the slot when the holder ends, it has waited past its max_wait: it fails
    # with WaitTooLong instead of running, and the signal says how long it waited
    result = AsyncResult(waiter, app=workers.client)
    wait_for(lambda: result.state == "FAILURE", 30, what="the waiter's failure")
    assert isinstance(result.result, WaitTooLong) and "max_wait of 2.0s" in str(result.result), result.result
    gave_up = [json.loads(x) for x in workers.records.lrange(f"{workers.prefix}:gave-up", 0, -1)]
    mine = [g for g in gave_up if g["id"] == waiter]
    assert mine and mine[0]["wait"] > 2 and mine[0]["max_wait"] == 2, mine
    assert not [json.loads(x) for x in workers.records.lrange(f"{workers.prefix}:began", 0, -1)
                if json.loads(x)["label"] == label]
    result.forget()


@pytest.mark.pure
def test_max_wait_is_checked_where_it_is_declared() -> None:
    # Given bad values in the decorator, a rule and the setting, Then each is refused there
    with pytest.raises(ConfigurationError, match="max_wait must be a positive number"):
        throttle("1/s", max_wait=0)
    with pytest.raises(ConfigurationError, match=r"throttle_rules\['a.\*'\].*max_wait"):
        ThrottleSpec.from_rule("a.*", {"rate": "1/s", "max_wait": "soon"})
    with pytest.raises(ConfigurationError, match="throttle_max_wait"):
        Settings(max_wait=-1).validated()
    # And good ones are kept
    assert ThrottleSpec.from_rule("a.*", {"rate": "1/s", "max_wait": 30}).max_wait == 30
