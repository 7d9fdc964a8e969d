"""A journal that refuses a task's copy: the task is never left in the store alone.

The journal is the broker's copy of every task waiting in a line; a task whose copy cannot
be written there (the broker restarting, its queue refusing the write) would wait in the
store alone, and a store restarted empty a moment later would lose it where plain Celery
loses nothing. Here the broker is a Redis whose journal key holds a string, so that every
write to the journal fails while the task queues take theirs: the task goes to the
broker's queue itself, naming the entry it holds in its line, and still runs once.

Each test drives the real code (a Redis broker, a redis-server of the test's own as store,
no worker processes: the pool's check is run by hand, as tests/faults/test_keeper_faults.py
does), with a control in which the journal takes the copies.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_throttle.celery_parts.journal_queue import journal_queue_name
from celery_throttle.core.header import HEADER, Header
from celery_throttle.core.keys import state_key
from tests.conftest import _clean
from tests.helpers import BROKER_URL, NOTES_URL, RedisServer, WorkerGroup, delete_queues, new_label, wait_for
from tests.journal_support import Deploy, make_deploy, send, start, teardown


@pytest.fixture(params=[True, False], ids=["journal-refuses", "control-journal-takes"])
def deploy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Deploy, bool]]:
    refuses = request.param
    d = make_deploy(monkeypatch, broker=BROKER_URL)
    journal = d.ctl.lines.journal.broker.name
    with redis.Redis.from_url(BROKER_URL) as client:
        if refuses:
            client.set(journal, "not a queue")  # (every write to it fails: WRONGTYPE)
    try:
        yield d, refuses
    finally:
        with redis.Redis.from_url(BROKER_URL) as client:
            client.delete(journal)
        teardown(d)


def _pending(headers: dict[str, Any]) -> str:
    return Header.read(headers.get(HEADER)).pending


def test_tasks_kept_at_publish_whose_copies_the_journal_refuses_go_to_the_queue_and_run_once(
        deploy: tuple[Deploy, bool]) -> None:
    d, refuses = deploy
    # Given a key of 1/h: of 4 sends, the first starts and 3 wait in its line at publish
    ids = send(d, 4)
    waiting = {w.task_id: w.entry for w in d.waiting()}
    assert sorted(waiting) == sorted(ids[1:])
    # Then, the journal refusing their copies, each of the 3 is in the broker's queue all
    # the same, naming the entry it holds in its line (in the control, only the first)
    queued = dict(d.taken())
    if not refuses:
        assert sorted(queued) == [ids[0]]
        return
    assert sorted(queued) == sorted(ids)
    assert {task_id: _pending(queued[task_id]) for task_id in waiting} == waiting
    # And each runs once: a copy checked while its entry waits is told so (and, the journal
    # still refusing, sent back to the queue naming it again)...
    head = ids[1]
    assert start(d, head, queued[head], 1) is False
    (again, headers), = d.taken()
    assert again == head and _pending(headers) == waiting[head]
    # ...and once the line released it and its released message ran, a copy is dropped
    d.ctl.set_limit("keeper.work", ["2/h"], key="acme")
    d.ctl.checker.refresh_controls()
    d.ctl.lines.release(d.key)
    (released_id, released), = d.taken()
    assert released_id == head
    assert start(d, head, released, 1) is True
    assert start(d, head, headers, 1) is False


def test_a_task_that_waits_after_the_pools_check_is_sent_back_when_the_journal_refuses_its_copy(
        deploy: tuple[Deploy, bool]) -> None:
    d, refuses = deploy
    send(d, 1)
    d.taken()
    # Given a key at its limit, when a task sent unchecked (no check at publish) reaches
    # the pool's check: it waits in its line
    task_id = str(uuid.uuid4())
    assert start(d, task_id, {}, 7) is False
    entry = {w.task_id: w.entry for w in d.waiting()}[task_id]
    # Then, the journal refusing its copy, it is sent back to the queue (its message is
    # acked then) naming its entry, and never runs twice; in the control, it waits in the
    # line and the journal alone
    taken = d.taken()
    if not refuses:
        assert taken == []
        return
    (copy_id, headers), = taken
    assert copy_id == task_id and _pending(headers) == entry
    d.ctl.set_limit("keeper.work", ["2/h"], key="acme")
    d.ctl.checker.refresh_controls()
    d.ctl.lines.release(d.key)
    (_, released), = d.taken()
    assert start(d, task_id, released, 7) is True
    assert start(d, task_id, headers, 7) is False


def test_a_store_restarted_empty_loses_no_task_whose_copy_the_journal_refused() -> None:
    # Given a worker whose Redis broker refuses every write to the journal, and a store of
    # its own that keeps nothing on disk
    server = RedisServer().start()
    group = WorkerGroup(prefix=f"ct-test-{uuid.uuid4().hex[:10]}", broker=BROKER_URL, store=server.url, count=1)
    journal = journal_queue_name(group.prefix)
    label, tenant = new_label(), f"refused-{new_label()}"
    with redis.Redis.from_url(BROKER_URL) as broker:
        broker.set(journal, "not a queue")
    try:
        group.start()
        # When 12 tasks of one tenant under 3/4s are sent by a producer that never installed
        # the plugin (the worker puts them in the key's line), and the store is killed and
        # started again, empty, while they wait
        ids = [group.send("slow_quota", label, tenant) for _ in range(12)]
        line = f"{state_key(group.prefix, 'tests.taskapp.slow_quota', tenant)}:line"
        with redis.Redis.from_url(server.url) as store:
            wait_for(lambda: store.zcard(line) >= 6, 20, 0.1, what="tasks waiting in the line")
        server.kill()
        RedisServer.start(server)
        # Then every task runs, each once: none was left in the store alone
        starts = group.wait_starts(label, len(ids), timeout=60)
        assert sorted(e["id"] for e in starts) == sorted(ids)
        assert "could not write task" in group.log_text()
    finally:
        group.stop()
        server.stop()
        with redis.Redis.from_url(BROKER_URL) as broker:
            broker.delete(journal)
        delete_queues(BROKER_URL, group.queues)
        with redis.Redis.from_url(NOTES_URL) as notes:
            _clean(notes, group.prefix)  # (the workers' notes of starts and denials)
