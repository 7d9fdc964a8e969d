"""The journal without a store loss: a task that waited, was released and ran is never
sent on by the keeper, also once the store has forgotten it started (USED_KEEP_MS).

Its latest event is the 'gone' of its release; the store, after USED_KEEP_MS, no longer
knows the entry. A keeper that sent on whatever the store does not know (rather than what
waits by the journal's latest event) would run it twice. A real RabbitMQ and a
redis-server of the test's own, whose script remembers started entries 2 s (not 10
minutes: the same rule, sooner); the passes are run by hand and the pool's hook is called
as a worker's pool calls it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu.connection import Connection
from kombu.entity import Queue

from celery_throttle import throttle
from celery_throttle.check.limiter import Throttle
from celery_throttle.core import journal
from celery_throttle.core.header import HEADER
from celery_throttle.core.keys import state_key
from celery_throttle.core.timing import ScriptPolicy
from celery_throttle.integration.hook import guard
from celery_throttle.integration.publish import wrap_send_task
from celery_throttle.integration.trace import attach
from celery_throttle.store.client import RedisStore
from celery_throttle.waits.keeper import Keeper
from tests.conftest import RABBITMQ_URL
from tests.helpers import RedisServer, delete_queues, rabbitmq_or_skip

LOST_AFTER_US = 300_000
USED_KEEP_MS = 2000


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Celery, Any, Throttle, str]]:
    broker = rabbitmq_or_skip(RABBITMQ_URL)
    monkeypatch.setattr(journal, "LOST_AFTER_US", LOST_AFTER_US)
    server = RedisServer().start()
    prefix = f"ct-test-{uuid.uuid4().hex[:10]}"
    app = Celery("journal-guard", broker=broker, set_as_current=False)
    app.conf.task_default_queue = f"{prefix}-q"

    @app.task(name="keeper.work", shared=False)
    @throttle("1/h", key="{tenant}")
    def work(tenant: str, n: int) -> None: ...

    ctl = Throttle(app, {"redis_url": server.url, "key_prefix": prefix, "journal": True})
    policy = ScriptPolicy(used_keep_ms=USED_KEEP_MS)
    ctl.setup._store = RedisStore(server.url, prefix, policy=policy)
    ctl.setup._quick_store = RedisStore(server.url, prefix, policy=policy)
    app._celery_throttle = ctl  # (what controller(app) answers: the hook's controller)
    wrap_send_task(ctl)
    try:
        yield app, work, ctl, prefix
    finally:
        ctl.close()
        server.stop()
        delete_queues(broker, [f"{prefix}-q", ctl.lines.journal.broker.name])


def _taken(app: Celery) -> list[tuple[str, dict]]:
    """(task id, headers) of every message in the task queue (taken out)."""
    got = []
    with Connection(app.conf.broker_url) as conn:
        bound = Queue(app.conf.task_default_queue)(conn.default_channel)
        bound.declare()
        while (message := bound.get(no_ack=True)) is not None:
            got.append((message.headers["id"], dict(message.headers)))
    return got


def test_a_task_released_from_its_line_and_run_is_never_sent_on_once_the_store_forgets_it(world) -> None:
    app, work, ctl, prefix = world
    key = state_key(prefix, "keeper.work", "acme")
    # Given tasks waiting in a line (the journal on), the head released (the key raised
    # to 2/h) and its released message run by the pool's hook
    for n in range(4):
        work.delay("acme", n)
    _taken(app)  # (the one that fit at publish)
    head = next(w for w in ctl.lines.waiting() if w.place)
    ctl.set_limit("keeper.work", ["2/h"], key="acme")
    ctl.checker.refresh_controls()
    ctl.lines.release(key)
    (task_id, headers), = _taken(app)
    assert task_id == head.task_id
    task = work._get_current_object()
    attach(task, ctl.checker.known(app, "keeper.work", None).spec)  # (as the worker's bootstep does)
    task.push_request(id=task_id, headers={HEADER: headers[HEADER]}, delivery_info={"redelivered": False},
                      is_eager=False, called_directly=False, args=["acme", 0], kwargs={}, **{HEADER: headers[HEADER]})
    try:
        assert guard(task, ("acme", 0), {}) is True  # (its body runs)
    finally:
        task.pop_request()
    # When the store has forgotten it started, and the keeper looks again and again
    time.sleep(USED_KEEP_MS / 1000 + 0.5)
    keeper = Keeper(ctl.setup, ctl.lines)
    try:
        for _ in range(3):
            keeper.pass_now()
            time.sleep(LOST_AFTER_US / 1e6 + 0.1)
    finally:
        keeper._close()
    # Then nothing is sent on, and the others still wait
    assert _taken(app) == []
    assert len([w for w in ctl.lines.waiting() if w.place]) == 2


def test_a_kept_event_names_the_epoch_of_the_store_its_call_went_to_though_the_store_restarted_since() -> None:
    # Given a process that read the store's epoch, and a store that then restarts empty
    # between a task's call (it joined the line of the store that is lost) and the
    # process's next read of the epoch (made anew by the next writer)
    server = RedisServer().start()
    app = Celery("epoch", broker="memory://", set_as_current=False)
    ctl = Throttle(app, {"redis_url": server.url, "key_prefix": f"ct-test-{uuid.uuid4().hex[:10]}",
                         "journal": True})
    try:
        journaling = ctl.lines.journal
        journaling.prime()
        before = journaling.epoch(ctl.store.now_us())
        assert before
        call_us = ctl.store.now_us()
        server.kill()
        server.start()
        journaling._epoch = (journaling._epoch[0], journaling._epoch[1], 0.0)  # (due for a read)
        # Then the event of that call names the lost store's epoch (the keeper sends the
        # task on: the new store does not know it and has another epoch), and a call made
        # after the restart names the new one
        assert journaling.epoch(call_us) == before
        after = journaling.epoch(ctl.store.now_us())
        assert after and after != before
        # And a process that read no epoch before its call (its read at start failed)
        # names none for a call older than the epoch (the keeper sends it on if the store
        # does not know it), and one that read it first (as every worker and producer
        # does) names it for its calls
        fresh = Throttle(app, {"redis_url": server.url, "key_prefix": ctl.settings.key_prefix, "journal": True})
        assert fresh.lines.journal.epoch(call_us) == ""
        fresh.close()
        primed = Throttle(app, {"redis_url": server.url, "key_prefix": ctl.settings.key_prefix, "journal": True})
        primed.lines.journal.prime()
        assert primed.lines.journal.epoch(primed.store.now_us()) == after
        primed.close()
    finally:
        ctl.close()
        server.stop()
