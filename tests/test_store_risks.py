"""The store checked as operators run it: eviction policies, no persistence, restarts.

Each test starts a redis-server of its own (tests.helpers.RedisServer), configured as
managed caches often are, and a real worker whose store it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import redis

from tests.helpers import BROKER_URL, ROOT, RedisServer, WorkerGroup, wait_for


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
