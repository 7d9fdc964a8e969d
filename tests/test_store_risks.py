"""The store checked as operators run it: eviction policies, no persistence, restarts.

Each test starts a redis-server of its own (tests.helpers.RedisServer), configured as
managed caches often are, and a real worker whose store it is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import pytest
import redis
from celery import Celery

import celery_throttle
from celery_throttle.controls import CONTROL_REFRESH
from tests.conftest import RABBITMQ_URL
from tests.helpers import (
    BROKER_URL,
    ROOT,
    STORE_URL,
    RedisServer,
    WorkerGroup,
    assert_each_ran_once,
    delete_queues,
    new_label,
    rabbitmq_or_skip,
    run_cli,
    wait_for,
)


def _doctor(store_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CT_STORE": store_url, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.taskapp", "throttle", "doctor"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_a_store_that_evicts_and_keeps_nothing_on_disk_is_named_at_worker_start_and_by_doctor() -> None:
    # Given a store as a managed cache often is: allkeys-lru, nothing on disk
    server = RedisServer(extra=["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"]).start()
    group = WorkerGroup(prefix=f"ct-test-{uuid.uuid4().hex[:10]}", broker=BROKER_URL, store=server.url, count=1)
    try:
        # When a worker starts on it
        group.start()
        # Then its start line names the throttled tasks and the store, and each risk is
        # a warning that says what can be lost
        log = group.log_text()
        assert "celery_throttle: throttling " in log and "tests.taskapp.below" in log
        assert "maxmemory-policy is allkeys-lru" in log and "parked tasks" in log
        assert "keeps nothing on disk" in log
        # And `throttle doctor` says the same, failing
        out = _doctor(server.url)
        assert out.returncode == 1 and out.stdout.count("RISK: ") == 2, out.stdout + out.stderr
    finally:
        group.stop()
        server.stop()


def test_a_store_without_risks_passes_doctor() -> None:
    server = RedisServer(extra=["--maxmemory-policy", "noeviction", "--appendonly", "yes"]).start()
    try:
        out = _doctor(server.url)
        assert out.returncode == 0 and "ok: no eviction" in out.stdout, out.stdout + out.stderr
    finally:
        server.stop()


def test_a_store_that_restarts_empty_is_noticed_by_the_running_worker() -> None:
    # Given a worker whose store keeps nothing on disk
    server = RedisServer().start()
    group = WorkerGroup(prefix=f"ct-test-{uuid.uuid4().hex[:10]}", broker=BROKER_URL, store=server.url, count=1)
    try:
        group.start()
        # When the store is killed and started again, empty, on the same port
        server.kill()
        RedisServer.start(server)
        redis.Redis.from_url(server.url).ping()
        # Then the worker logs that it restarted, and what may be lost, within its watch
        # interval (10 s) and a round
        wait_for(lambda: "the throttle store restarted" in group.log_text(), 30, 0.2, "the restart logged")
        assert "parked tasks" in group.log_text()
    finally:
        group.stop()
        server.stop()


#: Tasks the durability test sends.
SENT = 15


@pytest.mark.parametrize("held", [False, True], ids=["long waits", "held by a pause"])
def test_with_a_rabbitmq_broker_a_store_restarted_empty_loses_no_parked_task(
        held: bool, store_client: redis.Redis) -> None:
    # Given a RabbitMQ broker, and a store that keeps nothing on disk
    broker = rabbitmq_or_skip(RABBITMQ_URL)
    server = RedisServer().start()
    group = WorkerGroup(prefix=f"ct-test-{uuid.uuid4().hex[:10]}", broker=broker, store=server.url, count=1,
                        env={"CT_PARK_AFTER": "1"})
    label, tenant = new_label(), f"durable-{new_label()}"
    try:
        group.start()
        if held:  # (a pause of this tenant: every task it holds is parked, however short its wait)
            app = Celery("operator", broker=broker, set_as_current=False)
            ctl = celery_throttle.Throttle(app, {"redis_url": server.url, "key_prefix": group.prefix})
            ctl.pause("tests.taskapp.slow_quota", key=tenant, seconds=600)
            ctl.close()
            time.sleep(CONTROL_REFRESH + 0.2)
        # When 15 tasks of one tenant under 3/4s are sent: 12 parked (their waits of 4 to
        # 16 s: the last still wait while the CLI below runs on a loaded machine), or all 15
        # held by the pause
        ids = [group.send("slow_quota", label, tenant) for _ in range(SENT)]
        parked = SENT if held else SENT - 3
        wait_for(lambda: sum(d["parked"] for d in group.denials() if d["id"] in ids) >= parked, 20, 0.1,
                 what=f"{parked} parked tasks")
        # (kept in the broker: the store holds none of them)
        with redis.Redis.from_url(server.url) as store:
            assert store.zcard(f"{group.prefix}:{{parked}}:due") == 0
        # (and `throttle why` says where one waits, `throttle parked` how many)
        why = run_cli(group, "why", ids[-1])
        assert ("held in the broker until the pause" if held else "parked in the broker's delay queues") \
            in why.stdout, (why.stdout, why.stderr)
        counts = re.search(r"in the broker: (\d+) in its delay queues \(of every app on it\), (\d+) held by a pause",
                           run_cli(group, "parked").stdout)
        assert counts is not None and (int(counts[2]) == SENT if held else int(counts[1]) >= 6), counts
        # And the store is killed and started again, empty (its pause gone with it)
        server.kill()
        RedisServer.start(server)
        # Then every task runs, once
        starts = group.wait_starts(label, SENT, timeout=60)
        assert_each_ran_once(starts, ids)
        assert "could not park" not in group.log_text()
    finally:
        group.stop()
        server.stop()
        delete_queues(broker, group.queues)
        for key in store_client.scan_iter(match=f"{group.prefix}*", count=1000):
            store_client.delete(key)


def test_a_task_parked_in_the_broker_twice_reaches_its_queue_twice(store_client: redis.Redis) -> None:
    # Given a RabbitMQ broker, and a task parked in its delay queues for 3.6 s (through
    # two of them: 2 s, then 1 s), that has reached its queue, dead-lettered by both
    from kombu import Connection, Queue

    from celery_throttle.deferral import TurnedAway

    broker = rabbitmq_or_skip(RABBITMQ_URL)
    prefix = f"ct-test-{uuid.uuid4().hex[:10]}"
    queue = f"{prefix}-q"
    app = Celery("twice", broker=broker, set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=True)
    ctl = celery_throttle.install(app, redis_url=STORE_URL, key_prefix=prefix, park_after=1.0)

    @app.task(name="twice.job")
    @celery_throttle.throttle("1/s")
    def job_of(x):
        return x

    job = app.tasks["twice.job"]  # (a worker's view of it: the app finalized)

    def arrived(timeout: float = 10) -> object:
        deadline = time.monotonic() + timeout
        with Connection(broker) as conn:
            while time.monotonic() < deadline:
                message = Queue(queue).bind(conn.default_channel).get(no_ack=True)
                if message is not None:
                    return message
                time.sleep(0.05)
        return None

    try:
        with app.connection_for_write() as conn:
            Queue(queue).bind(conn.default_channel).declare()
        now = ctl.store.now_us()
        celery_throttle.parking.park(ctl, job.signature((1,), task_id="twice-1", queue=queue), now + 3_600_000,
                                     now_us=now)
        first = arrived()
        assert first is not None and "x-death" in first.headers, "not through the delay queues"
        # When a worker turns it away again for as long (it is sent back as a worker does it)
        from celery.worker.request import Request

        context = Request(first, app=app, task=job)._context
        call = ctl.checker.bind(job, (1,), {})
        TurnedAway(ctl, job, context, (1,), {}, call, {}).send_back(3.6, ctl.store.now_us())
        # Then it reaches its queue again (RabbitMQ drops a message that passes a delay
        # queue it was dead-lettered from before, if it still carries the record of it)
        again = arrived()
        assert again is not None and again.headers["id"] == "twice-1"
    finally:
        ctl.close()
        delete_queues(broker, [queue, f"{prefix}.held"])
        for key in store_client.scan_iter(match=f"{prefix}*", count=1000):
            store_client.delete(key)
