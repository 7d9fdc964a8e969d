"""Admission at publish: a producer defers a throttled task that does not fit.

Every producer here is ``tests.producer``: a process of its own that imports the task
module (which calls ``install(app)``) and sends, as a script, a web view or beat does. It
never finalizes the app. The workers are real subprocesses. The other behaviour tests
send by name from an app without ``install``, which skips this step, so they keep
testing the worker's own checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.helpers import (
    BROKER_URL,
    ROOT,
    STORE_URL,
    WorkerGroup,
    assert_each_ran_once,
    delete_queues,
    free_port,
    max_started_in,
    new_label,
    run_producer,
)

#: Every way a task is sent, and how it is declared: decorator below and above
#: ``@app.task``, a bound task, ``@shared_task``, a rule, ``send_task`` by name (of a
#: rule's task and of a decorated one) and a group. Each task is ``3/10s`` per tenant.
WAYS = {
    "below @app.task": ("delay", "pub_below"),
    "above @app.task": ("delay", "pub_above"),
    "bind=True": ("delay", "pub_bound"),
    "@shared_task": ("delay", "pub_shared"),
    "rule": ("delay", "unowned_pub"),
    "send_task, rule": ("send_task", "unowned_pub"),
    "send_task, decorated": ("send_task", "pub_below"),
    "group": ("group", "pub_below"),
}


@pytest.fixture
def idle_queue(store_client: redis.Redis) -> Iterator[dict[str, str]]:
    """The environment of a producer whose queue no worker consumes (a deploy, workers
    that scale from zero): its messages stay there to be counted. Deleted afterwards,
    with every key of its prefix."""
    prefix = f"ct-test-{uuid.uuid4().hex[:10]}"
    env = {"CT_PREFIX": prefix, "CT_QUEUE": f"{prefix}-q", "CT_BROKER": BROKER_URL, "CT_STORE": STORE_URL,
           "CT_RECORDS": STORE_URL, "PYTHONPATH": str(ROOT)}
    yield env
    broker = redis.Redis.from_url(BROKER_URL)
    for raw in broker.lrange(env["CT_QUEUE"], 0, -1):
        broker.delete(f"celery-task-meta-{json.loads(raw)['headers']['id']}")
    broker.delete(env["CT_QUEUE"])
    broker.close()
    delete_queues(BROKER_URL, [env["CT_QUEUE"]])  # (and the bindings the producer declared)
    for key in store_client.scan_iter(match=f"{prefix}*", count=1000):
        store_client.delete(key)


@pytest.mark.parametrize("way", list(WAYS))
def test_every_way_of_sending_from_a_producer_that_never_finalizes_is_admitted_at_publish(
    way: str, idle_queue: dict[str, str], store_client: redis.Redis
) -> None:
    # Given a producer that imports the task module and sends, and no worker running
    how, task = WAYS[way]
    label, tenant = new_label(), f"t-{new_label()}"
    env = {**os.environ, **idle_queue}
    # When it sends 12 tasks of one tenant under 3/10s
    out = run_producer(env, {"how": how, "task": task, "args": [label, tenant], "count": 12})
    # Then it turned away all but 4 at publish (one sent unchecked on the key's room, and
    # the 3 more that fit, counted as they left), into their key's line (each waits 10 s
    # or more)
    denials = out["denials"]
    assert len(denials) == 8 and all(d["key"] == tenant for d in denials), denials
    sent = {i for ids in out["sent"] for i in ids}
    assert {d["id"] for d in denials} <= sent and len(sent) == 12
    # And only those 4 are in the queue; the 8 wait in the store
    broker = redis.Redis.from_url(BROKER_URL)
    assert broker.llen(idle_queue["CT_QUEUE"]) == 4
    broker.close()
    assert _waiting_in_lines(store_client, idle_queue["CT_PREFIX"]) == 8
    # And nothing finalized the app (but Celery's own proxy of a @shared_task, on use)
    assert out["finalized"] is (way == "@shared_task")
    # And `throttle status` counts the 8 waiting in the tenant's key's line
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.taskapp", "throttle", "status", "--json",
                           "--key-match", tenant], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert [k["waiting"] for k in json.loads(done.stdout)["keys"]] == [8], done.stdout


def _waiting_in_lines(client: redis.Redis, prefix: str) -> int:
    """The tasks waiting in every line under ``prefix``."""
    return sum(client.zcard(name) for name in client.scan_iter(match=f"{prefix}:*:line", count=1000))


def test_a_producer_holds_back_calls_by_the_unit_that_runs_out(idle_queue: dict[str, str],
                                                               store_client: redis.Redis) -> None:
    # Given a task of 20 requests and 8 tokens per 10 s, each call estimated at 4 tokens,
    # and no worker running
    label, tenant = new_label(), f"t-{new_label()}"
    env = {**os.environ, **idle_queue}
    # When a producer sends 12 calls of one tenant
    out = run_producer(env, {"how": "delay", "task": "tokens_estimated", "args": [label, tenant, 1], "count": 12})
    # Then the tokens hold them back, not the requests: the first is sent on the key's room
    # (half the tokens), the next two leave counted on the 8 tokens of the window, and the
    # other 9 wait in the key's line for the windows after (each waits 10 s or more)
    denials = out["denials"]
    assert len(denials) == 9 and all(d["key"] == tenant for d in denials), denials
    broker = redis.Redis.from_url(BROKER_URL)
    assert broker.llen(idle_queue["CT_QUEUE"]) == 3
    broker.close()
    assert _waiting_in_lines(store_client, idle_queue["CT_PREFIX"]) == 9


@pytest.mark.any_store
def test_a_flood_of_one_tenant_waits_outside_the_queue_and_other_tenants_start_at_once(
    workers: WorkerGroup,
) -> None:
    # Given a 3/4s-per-tenant task
    label, flood, other = new_label(), f"flood-{new_label()}", f"other-{new_label()}"
    # When a producer sends 15 tasks of tenant A at once, then 3 of tenant B
    out = workers.produce({"how": "delay", "task": "slow_quota", "args": [label, flood], "count": 15},
                          {"how": "delay", "task": "slow_quota", "args": [label, other], "count": 3})
    a_ids, b_ids = out["sent"]
    # Then the producer turned away 11 or 12 of A's (into its line: the shortest wait is 4 s) and
    # none of B's: the queue got A's first 3, and the one sent on A's room unchecked unless
    # a worker had already started that one and counted it
    assert [d["key"] for d in out["denials"]] in ([flood] * 11, [flood] * 12)
    # And B's tasks started at once, while every one of A's ran once within its limit
    starts = workers.wait_starts(label, 18, timeout=40)
    assert_each_ran_once(starts, a_ids + b_ids)
    by_id = {e["id"]: e for e in starts}
    first_a = min(by_id[i]["t"] for i in a_ids)
    assert max(by_id[i]["t"] for i in b_ids) - first_a < 2.0
    assert max_started_in([by_id[i]["t"] for i in a_ids], 4.0) <= 3
    # And the workers did not have to turn the flood away: at most the one sent on the
    # room, and a task or two released from the line a little early
    assert len([d for d in workers.denials() if d["id"] in a_ids + b_ids]) <= 4


def test_a_chord_whose_tasks_waited_in_a_line_from_publish_still_completes(workers: WorkerGroup) -> None:
    # Given a chord of 5 tasks of one tenant under 3/4s, with an unthrottled callback
    label, tenant = new_label(), f"chord-{new_label()}"
    # When a producer sends it (1 of the 5 waits in the line from publish, or 2 if a worker
    # counted the one sent on the key's room before the last was admitted)
    out = workers.produce({"how": "chord", "task": "slow_quota", "args": [label, tenant], "count": 5})
    assert len(out["denials"]) in (1, 2)
    # Then all 5 ran, and the callback ran once with the 5 results
    starts = workers.wait_starts(label, 6, timeout=40)
    callbacks = [e for e in starts if "n" in e]
    assert [e["n"] for e in callbacks] == [5]
    assert max_started_in([e["t"] for e in starts if "n" not in e], 4.0) <= 3


def test_a_producer_that_cannot_reach_the_store_sends_unchecked_and_the_workers_throttle(
    workers: WorkerGroup,
) -> None:
    # Given a producer whose throttle store is down (nothing listens on its port)
    label, tenant = new_label(), f"nostore-{new_label()}"
    # When it sends 6 tasks of a 3/4s tenant
    out = workers.produce({"how": "delay", "task": "slow_quota", "args": [label, tenant], "count": 6},
                          CT_STORE=f"redis://127.0.0.1:{free_port()}/0")
    # Then it said so once (not once per task), every task was sent, and the workers,
    # which reach the store, held the limit
    assert out["log"].count("unreachable at publish") == 1, out["log"]
    starts = workers.wait_starts(label, 6, timeout=30)
    assert_each_ran_once(starts, out["sent"][0])
    assert max_started_in([e["t"] for e in starts], 4.0) <= 3
