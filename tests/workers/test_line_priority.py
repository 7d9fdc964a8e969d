"""Priority within a key's line, on real workers and both brokers: a task sent with a higher
priority (as its broker orders them: RabbitMQ the highest first, Redis 0 first) goes before
the tasks of its key waiting before it, whether it joined its line at publish or in a
worker; a throttle's own ``priority=`` orders the line in place of the message's, bound to
the task's arguments however it was called.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers import WorkerGroup, assert_each_ran_once, new_label

#: Bulk tasks sent before the urgent one: at 2/s, 10 of them wait in their key's line.
BULK = 12


def _order(starts: list[dict], urgent: str) -> str:
    t0 = min(e["t"] for e in starts)
    return "starts (s, urgent?): " + str([(round(e["t"] - t0, 2), e["id"] == urgent)
                                          for e in sorted(starts, key=lambda e: e["t"])])


def priorities(workers: WorkerGroup) -> tuple[int | None, int]:
    """(a bulk task's priority, an urgent one's) as the broker orders them."""
    return (9, 0) if workers.broker.startswith("redis") else (None, 9)


def urgent_rank(starts: list[dict], urgent: str) -> int:
    order = [e["id"] for e in sorted(starts, key=lambda e: e["t"])]
    return order.index(urgent)


@pytest.mark.any_store
@pytest.mark.parametrize("path", ["publish", "worker"])
def test_an_urgent_task_goes_before_the_tasks_of_its_key_waiting_before_it(workers: WorkerGroup, path: str) -> None:
    # Given 12 bulk tasks of a key of 2/s (10 of them wait in its line, 5 s of them),
    # joined at publish by a producer, or in a worker
    label, tenant = new_label(), f"t-{new_label()}"
    bulk, urgent = priorities(workers)
    bulk_options = {} if bulk is None else {"priority": bulk}
    if path == "publish":
        produced = workers.produce(
            {"how": "apply_async", "task": "prioritized", "args": [label, tenant], "count": BULK, "options": bulk_options},
            {"how": "apply_async", "task": "prioritized", "args": [label, tenant], "options": {"priority": urgent}})
        ids, (urgent_id,) = produced["sent"]
    else:
        ids = [workers.send("prioritized", label, tenant, **bulk_options) for _ in range(BULK)]
        time.sleep(1.0)  # (the bulk reaches the workers, and its line, first)
        urgent_id = workers.send("prioritized", label, tenant, priority=urgent)
    # When they run
    starts = workers.wait_starts(label, BULK + 1, timeout=60)
    # Then each ran once, and the urgent one went before bulk tasks that waited in the line
    # before it came (first come first served, it would have started last; on a loaded
    # machine its message may reach its line a second or two late: still 4 before the end)
    assert_each_ran_once(starts, [*ids, urgent_id])
    assert urgent_rank(starts, urgent_id) < BULK - 4, _order(starts, urgent_id)


def test_a_throttles_own_priority_orders_its_line_whatever_the_message_says(workers: WorkerGroup) -> None:
    # Given a throttle whose priority is a callable over the task's arguments (a reset goes
    # before an export), 12 exports waiting, then a reset, called positionally
    label, tenant = new_label(), f"t-{new_label()}"
    produced = workers.produce(
        {"how": "delay", "task": "by_kind", "args": [label, tenant, "export"], "count": BULK},
        {"how": "delay", "task": "by_kind", "args": [label, tenant, "reset"]})
    exports, (reset,) = produced["sent"]
    # When they run
    starts = workers.wait_starts(label, BULK + 1, timeout=60)
    # Then the reset went before the exports that waited before it
    assert_each_ran_once(starts, [*exports, reset])
    assert urgent_rank(starts, reset) < BULK - 4, _order(starts, reset)
    assert not any("KeyBuildError" in line for line in workers.log_text().splitlines())
