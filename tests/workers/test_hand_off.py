"""The hand-off with real workers (celery_parts/hand.py): on a Redis broker a task released
because a body ended goes to that body's worker, through the worker's own queue, at
Celery's default prefetch (on RabbitMQ, and for a task acked late, to its own queue); one
handed to a worker that does not take it in time is put back in its place and runs
elsewhere, once, and the copy left in the worker's queue is dropped when it comes."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter

import redis

from celery_throttle.celery_parts.hand import hand_queue
from celery_throttle.core.header import HEADER
from celery_throttle.core.keys import state_key
from tests.conftest import _clean
from tests.helpers import BROKER_URL, STORE_URL, WorkerGroup, new_label, wait_for


def spans(group: WorkerGroup, label: str) -> list[dict]:
    raw = group.records.lrange(f"{group.prefix}:spans", 0, -1)
    return [e for e in (json.loads(x) for x in raw) if e["label"] == label]


def test_a_task_released_by_a_body_s_end_starts_on_that_body_s_worker(store_client: redis.Redis,
                                                                      broker_url: str) -> None:
    group = WorkerGroup(f"ct-test-hand-{uuid.uuid4().hex[:8]}", broker_url, STORE_URL, count=2, concurrency=2)
    label = new_label()
    try:
        group.start()
        for i in range(16):
            group.send("exporting", label, "solo", 0.2)  # (concurrency=2 per tenant)
        wait_for(lambda: len(spans(group, label)) >= 16, 60, 0.1, "16 bodies")
        time.sleep(0.5)
        got = spans(group, label)
    finally:
        group.stop()
        _clean(store_client, group.prefix)
    assert len(got) == 16 and len({s["id"] for s in got}) == 16, Counter(s["id"] for s in got)
    handed = [s for s in got if (s["via"] or "").endswith(".throttle-hand")]
    if broker_url.startswith("amqp"):  # (RabbitMQ gives a released task to a worker with room)
        assert not handed, handed
        return
    # (the first two go through the common queue: no body had ended; most of the others
    # are handed, each to the worker whose body's end released it)
    assert len(handed) >= 8, [(s["via"], s["hostname"]) for s in got]
    assert all(s["via"] == hand_queue(s["hostname"]).name for s in handed), [(s["via"], s["hostname"]) for s in handed]
    edges = sorted([(s["t0"], 1) for s in got] + [(s["t1"], -1) for s in got])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    assert most <= 2


def test_a_task_acked_late_is_not_handed(store_client: redis.Redis) -> None:
    """Killed mid-body, it is given back to the queue it came from: its own, which every
    worker consumes."""
    group = WorkerGroup(f"ct-test-hand-{uuid.uuid4().hex[:8]}", BROKER_URL, STORE_URL, count=2, concurrency=2,
                        env={"CT_ACKS_LATE": "1"})
    label = new_label()
    try:
        group.start()
        for _ in range(8):
            group.send("exporting", label, "solo", 0.1)
        wait_for(lambda: len(spans(group, label)) >= 8, 60, 0.1, "8 bodies")
        got = spans(group, label)
    finally:
        group.stop()
        _clean(store_client, group.prefix)
    assert {s["via"] for s in got} == {group.queue}, got


def test_a_task_handed_to_a_worker_that_does_not_take_it_goes_again_and_runs_once(store_client: redis.Redis) -> None:
    broker_url = BROKER_URL
    """Worker 0 stops taking from its own queue while its body runs: the task that body's
    end releases is handed there and sits. Within the send lease the store puts it back in
    its place; a releaser releases it again, and it runs. When worker 0
    takes from its queue again, the copy there finds its ticket used and is dropped."""
    group = WorkerGroup(f"ct-test-hand-{uuid.uuid4().hex[:8]}", broker_url, STORE_URL, count=2, concurrency=1)
    label = new_label()
    try:
        group.start_one(0)
        group.wait_ready(0)
        first = group.send("single_slot", label, "t", 3.0)
        wait_for(lambda: group.records.llen(f"{group.prefix}:began") >= 1, 30, 0.05, "the first body")
        own = hand_queue(group.hostname(0)).name
        replies = group.client.control.cancel_consumer(own, destination=[group.hostname(0)], reply=True, timeout=5)
        assert replies, "worker 0 did not answer cancel_consumer"
        second = group.send("single_slot", label, "t", 0.1)
        group.start_one(1)
        group.wait_ready(1)
        wait_for(lambda: len(spans(group, label)) >= 2, 60, 0.1, "both bodies")
        got = {s["id"]: s for s in spans(group, label)}
        # (released again after the send lease: to the common queue, or handed to an idle worker's own)
        assert got[first]["hostname"] == group.hostname(0) and got[second]["via"] != own, got
        # Worker 0 takes from its own queue again: the copy handed there comes, and is dropped.
        group.client.control.add_consumer(own, destination=[group.hostname(0)], reply=True, timeout=5)
        wait_for(lambda: "is a copy of a task that started lately" in group.log_text(), 30, 0.2,
                 "the handed copy dropped")
        time.sleep(0.5)
        ran = Counter(s["id"] for s in spans(group, label))
    finally:
        group.stop()
        _clean(store_client, group.prefix)
    assert ran == {first: 1, second: 1}, ran


def test_a_forged_ticket_sent_to_a_worker_s_own_queue_grants_nothing_and_is_not_lost(store_client: redis.Redis) -> None:
    """A producer that never installed the plugin sends tasks straight to a worker's own
    queue, with tickets it made up, while the key's one slot is held: none starts beside
    the holder, none is dropped (a busy worker hands back only what the store sent on again)."""
    group = WorkerGroup(f"ct-test-hand-{uuid.uuid4().hex[:8]}", BROKER_URL, STORE_URL, count=1, concurrency=2)
    label = new_label()
    try:
        group.start()
        holder = group.send("single_slot", label, "f", 2.0)
        wait_for(lambda: group.records.llen(f"{group.prefix}:began") >= 1, 30, 0.05, "the holder's body")
        key = state_key(group.prefix, "single-slot", "f")
        forged = []
        for i in range(4):
            task_id = str(uuid.uuid4())
            forged.append(group.send("single_slot", label, "f", 0.1, task_id=task_id,
                                     queue=hand_queue(group.hostname(0)).name,
                                     headers={HEADER: {"v": 3, "n": 0, "k": key, "t": f"{task_id}:forged{i}"}}))
        wait_for(lambda: len(spans(group, label)) >= 5, 60, 0.1, "the holder and the 4 forged")
        got = spans(group, label)
    finally:
        group.stop()
        _clean(store_client, group.prefix)
    assert Counter(s["id"] for s in got) == Counter([holder, *forged]), got
    ends = {s["id"]: s["t1"] for s in got}
    assert all(s["t0"] >= ends[holder] - 0.05 for s in got if s["id"] != holder), got  # (one slot: after it)
