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

from celery_throttle.core.keys import state_key
from tests.conftest import RABBITMQ_URL
from tests.helpers import (
    BROKER_URL,
    ROOT,
    RedisServer,
    WorkerGroup,
    delete_queues,
    max_started_in,
    new_label,
    rabbitmq_or_skip,
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
        assert "maxmemory-policy is allkeys-lru" in log and "tasks waiting in the lines" in log
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
        assert "tasks waiting in its lines" in group.log_text()
    finally:
        group.stop()
        server.stop()


def test_a_store_that_is_the_brokers_own_database_is_said_to_fail_with_it() -> None:
    # Given a worker whose store is its Redis broker's own database (the default store of a
    # Redis broker), and one whose store is another server
    same = WorkerGroup(prefix=f"ct-test-{uuid.uuid4().hex[:10]}", broker=BROKER_URL, store=BROKER_URL, count=1)
    try:
        same.start()
        # Then its start line says that its lines fail only with the broker's queues, and
        # keeps no journal (a copy there would be lost with the line)
        log = same.log_text()
        assert "the store is the broker's own Redis database" in log, log
        assert "with a copy in the broker's journal" not in log
    finally:
        same.stop()
        delete_queues(BROKER_URL, same.queues)
        with redis.Redis.from_url(BROKER_URL) as client:
            for key in client.scan_iter(match=f"{same.prefix}*", count=1000):
                client.delete(key)


#: Tasks the restart test sends (3 start every 4 s: about 12 still wait when the store is
#: killed, 11 s after the line formed).
SENT = 24


@pytest.mark.parametrize("broker_kind", ["rabbitmq", "redis"])
def test_a_store_restarted_empty_loses_none_of_its_lines_whatever_the_broker(
        store_client: redis.Redis, broker_kind: str) -> None:
    # Given a RabbitMQ broker, or a Redis broker that survives (another server than the
    # store), and a store that keeps nothing on disk (a risk the worker names at start,
    # with the journal that covers the lines: on by default, the store not being the
    # broker's own database)
    broker = rabbitmq_or_skip(RABBITMQ_URL) if broker_kind == "rabbitmq" else BROKER_URL
    server = RedisServer().start()
    group = WorkerGroup(prefix=f"ct-test-{uuid.uuid4().hex[:10]}", broker=broker, store=server.url, count=1)
    label, tenant = new_label(), f"durable-{new_label()}"
    try:
        group.start()
        log = group.log_text()
        assert "keeps nothing on disk" in log and "sent on from the journal in the broker" in log, log
        assert "with a copy in the broker's journal" in log
        # When 24 tasks of one tenant under 3/4s are sent by a producer that never
        # installed the plugin: 21 wait in the key's line, and the store is killed and
        # started again, empty, while about 12 still wait
        ids = [group.send("slow_quota", label, tenant) for _ in range(SENT)]
        line = f"{state_key(group.prefix, 'tests.taskapp.slow_quota', tenant)}:line"
        with redis.Redis.from_url(server.url) as store:
            wait_for(lambda: store.zcard(line) >= 10, 20, 0.1, what="tasks waiting in the line")
        time.sleep(11)  # (a watch of the store has seen the line: at most 10 s apart)
        with redis.Redis.from_url(server.url) as store:
            waited = store.zcard(line)
        server.kill()
        restarted = time.time()
        RedisServer.start(server)
        # Then the worker says so, and that the lines are sent on from the journal; every
        # task runs, each once (those that waited, as new tasks of the key's line, after a
        # pass has found the store does not know them and a second one, 10 s later, still
        # does not), and the limit holds again from the restart on
        wait_for(lambda: "the throttle store restarted" in group.log_text(), 30, 0.2, "the restart logged")
        log = group.log_text()
        assert re.search(r"sent on from the journal \(1 key\(s\) had tasks waiting in their lines \d+s before", log), log
        starts = group.wait_starts(label, SENT, timeout=90)
        assert sorted(e["id"] for e in starts) == sorted(ids)
        after = sorted(e["t"] for e in starts if e["t"] > restarted)
        assert waited >= 6 and len(after) >= waited, (waited, starts)
        assert max_started_in(after, 4.0) <= 3, after
        assert re.search(r"the store lost \d+ task\(s\) waiting in 1 line\(s\): sent on from the journal", group.log_text())
    finally:
        group.stop()
        server.stop()
        delete_queues(broker, group.queues)
        for key in store_client.scan_iter(match=f"{group.prefix}*", count=1000):
            store_client.delete(key)


def test_a_line_whose_counts_and_index_entry_were_evicted_is_found_and_released_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_throttle.core.keys import line_index_key, window_keys
    from celery_throttle.waits.releaser import Releaser
    from tests.journal_support import make_deploy, send, teardown

    # Given 8 calls of a key at 1/h: one runs, 7 wait in its line
    d = make_deploy(monkeypatch)
    try:
        send(d, 8)
        first = d.sent_on(1)
        waiting = d.waiting_ids()
        assert len(first) == 1 and len(waiting) == 7
        # When a store evicting (allkeys-lru) takes the line's counts and its index entry,
        # and leaves its entries
        lm = window_keys(d.key)[1]
        with redis.Redis.from_url(d.server.url) as store:
            assert store.delete(lm) == 1 and store.zrem(line_index_key(d.prefix), d.key) == 1
            # Then the index sweep finds the line by its entries, and its next call counts
            # them again (taken for empty, it was dropped from the index for good)
            assert Releaser(d.ctl.setup, d.ctl.checker, d.ctl.lines).index_lost_lines() == 1
            assert store.zscore(line_index_key(d.prefix), d.key) is not None
            d.ctl.lines.release(d.key)
            assert int(store.hget(lm, "q")) == 7
        # and, given room, its tasks go in the order they came
        d.ctl.set_limit("keeper.work", "100/s", replace=True)
        d.ctl.checker.refresh_controls()
        d.ctl.lines.release(d.key)
        assert d.sent_on(len(waiting)) == waiting
    finally:
        teardown(d)


def test_a_line_evicted_whole_is_sent_on_from_the_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_throttle.core.keys import window_keys
    from tests.journal_support import LOOK, lined, make_deploy, teardown

    # Given 8 calls of a key at 1/h on a RabbitMQ broker (the journal on): one runs, 7
    # wait in its line, with their copies in the journal
    d = make_deploy(monkeypatch)
    try:
        waiting = lined(d, 8)
        assert len(waiting) == 7
        d.keeper.pass_now()
        # When the store evicts (a memory cap under volatile-lru takes a key with a TTL),
        # and the line's keys are among what it took
        with redis.Redis.from_url(d.server.url) as store:
            store.set("ct-test-ballast", "x" * 2_000_000, ex=3600)
            used = int(store.info("memory")["used_memory"])
            store.config_set("maxmemory-policy", "volatile-lru")
            store.config_set("maxmemory", used - 1_000_000)
            wait_for(lambda: int(store.info("stats")["evicted_keys"]) > 0, 5, what="an eviction")
            store.config_set("maxmemory", 0)
            _, lm, line, msgs, _, _, _ = window_keys(d.key)
            assert store.delete(lm, line, msgs) == 3
        # Then the keeper sends every one of them on, once: the store's epoch is new (its
        # count of evicted keys grew), so a task it no longer knows was lost, not gone
        # without a word (the keeper dropped them: 7 of 7 never ran)
        d.keeper.pass_now()
        time.sleep(LOOK)
        d.keeper.pass_now()
        assert sorted(d.sent_on(len(waiting))) == sorted(waiting)
    finally:
        teardown(d)


@pytest.mark.parametrize("messages", ["evicted", "the-heads-alone", "control-kept"])
def test_a_line_whose_messages_were_evicted_does_not_wait_on_its_head_for_good(
        monkeypatch: pytest.MonkeyPatch, messages: str) -> None:
    from celery_throttle.check.limiter import Throttle
    from celery_throttle.core.keys import window_keys
    from tests.journal_support import make_deploy, send, teardown

    # Given 5 calls of a key at 1/h on a RabbitMQ broker (the journal on): one runs, 4 wait
    # in its line, with their copies in the journal
    d = make_deploy(monkeypatch)
    other = Throttle(d.app, {"redis_url": d.server.url, "key_prefix": d.prefix, "journal": True})
    try:
        send(d, 5)
        d.sent_on(1)
        waiting, entries = d.waiting_ids(), [w.entry for w in d.waiting()]
        assert len(waiting) == 4
        d.keeper.pass_now()
        # When a store evicting takes the line's messages (or, as no eviction does, the
        # head's alone) and leaves its entries and counts, and a releaser that never bound a
        # task of the key (a worker started since) looks
        with redis.Redis.from_url(d.server.url) as store:
            line, msgs = window_keys(d.key)[2:4]
            if messages == "evicted":
                assert store.delete(msgs) == 1
            elif messages == "the-heads-alone":
                assert store.hdel(msgs, entries[0], f"{entries[0]}#") == 2
            other.lines.release(d.key)
            left = store.zcard(line)
        # Then the heads whose messages are gone are reported lost, and the keeper's next
        # look (a pass only if one is due) sends them on from the journal (the line waited
        # on its head for good, looked at every 5 s by a releaser that found no task to
        # bind; then, reported, they waited for the keeper's sweep, 10 minutes on, as no
        # pass was due); a head that has its message is not released by that call, which
        # knows none of the key's rates
        d.keeper.look()
        gone = {"evicted": 4, "the-heads-alone": 1, "control-kept": 0}[messages]
        assert left == 4 - gone
        assert d.sent_on(gone) == waiting[:gone]
    finally:
        other.close()
        teardown(d)
