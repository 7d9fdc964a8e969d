"""What the keeper's tests share: an app of one throttled task (``keeper.work``, 1/h a
tenant) with RabbitMQ as broker and a redis-server of the test's own as store, a producer
that checks at publish, and a keeper whose passes the test runs by hand."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
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

#: LOST_AFTER_US for these tests (µs): the passes are run by hand, a moment apart.
LOST_AFTER_US = 300_000
LOOK = LOST_AFTER_US / 1e6 + 0.1
#: Seconds a test waits for the tasks it expects in the task queue (a publish on another
#: connection lands a moment later: beside the suite, later than the test's next read).
SENT_WITHIN = 5.0


@dataclass
class Deploy:
    app: Celery
    ctl: Throttle
    keeper: Keeper
    server: RedisServer
    queue: str
    work: Any
    prefix: str

    @property
    def key(self) -> str:
        return state_key(self.prefix, "keeper.work", "acme")

    def waiting(self) -> list[Any]:
        return [w for w in self.ctl.lines.waiting() if w.place]

    def lose_the_store(self) -> None:
        with redis.Redis.from_url(self.server.url) as client:
            client.flushall()  # (the test's own server)

    def taken(self, expected: int = 0) -> list[tuple[str, dict]]:
        """(task id, headers) of every message in the task queue, in order (taken out),
        waiting up to SENT_WITHIN for ``expected`` of them: a publish on another connection
        (the keeper's, a producer's) reaches the queue a moment after it returns."""
        got = []
        deadline = time.monotonic() + SENT_WITHIN
        with Connection(self.app.conf.broker_url) as conn:
            bound = Queue(self.queue)(conn.default_channel)
            bound.declare()
            while True:
                while (message := bound.get(no_ack=True)) is not None:
                    got.append((message.headers["id"], dict(message.headers)))
                if len(got) >= expected or time.monotonic() > deadline:
                    return got
                time.sleep(0.05)

    def sent_on(self, expected: int = 0) -> list[str]:
        """The ids of the tasks in the task queue, in its order (taken out; ``expected``:
        see :meth:`taken`)."""
        return [task_id for task_id, _ in self.taken(expected)]

    def waiting_ids(self) -> list[str]:
        """The task ids waiting in the key's line, in its order."""
        return [w.task_id for w in self.waiting()]

    def journal_length(self) -> int:
        with Connection(self.app.conf.broker_url) as conn:
            return self.ctl.lines.journal.broker.length(conn)


def make_app(name: str, broker: str, queue: str) -> tuple[Celery, Any]:
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.task_default_queue = queue

    @app.task(name="keeper.work", shared=False)
    @throttle("1/h", key="{tenant}")
    def work(tenant: str, n: int) -> None: ...

    return app, work


def make_deploy(monkeypatch: pytest.MonkeyPatch, policy: ScriptPolicy | None = None, on: bool = True,
                broker: str | None = None) -> Deploy:
    """The deploy, on RabbitMQ or (``broker``) another broker."""
    broker = broker or rabbitmq_or_skip(RABBITMQ_URL)
    monkeypatch.setattr(journal, "LOST_AFTER_US", LOST_AFTER_US)
    server = RedisServer().start()
    prefix = f"ct-test-{uuid.uuid4().hex[:10]}"
    queue = f"{prefix}-q"
    app, work = make_app("journal", broker, queue)
    ctl = Throttle(app, {"redis_url": server.url, "key_prefix": prefix, "journal": on})
    if policy is not None:
        ctl.setup._store = RedisStore(server.url, prefix, policy=policy)
        ctl.setup._quick_store = RedisStore(server.url, prefix, policy=policy)
    app._celery_throttle = ctl  # (what controller(app) answers: the hook's)
    wrap_send_task(ctl)
    return Deploy(app, ctl, Keeper(ctl.setup, ctl.lines), server, queue, work, prefix)


@pytest.fixture
def deploy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Deploy]:
    d = make_deploy(monkeypatch)
    try:
        yield d
    finally:
        teardown(d)


def teardown(d: Deploy) -> None:
    d.keeper.stop()
    d.keeper._close()
    d.ctl.close()
    d.server.stop()
    delete_queues(d.app.conf.broker_url, [d.queue, d.ctl.lines.journal.broker.name])


def send(d: Deploy, count: int) -> list[str]:
    """``count`` calls of the tenant's task, sent at once (checked at publish)."""
    return [d.work.delay("acme", n).id for n in range(count)]


def lined(d: Deploy, count: int) -> list[str]:
    """``count`` calls of the tenant's task sent at once under 1/h: the first runs (taken
    from the queue), the others wait in the key's line. Their task ids, in its order."""
    send(d, count)
    d.sent_on()
    return d.waiting_ids()


def release_head(d: Deploy) -> None:
    """The key raised to 2/h and its line released: its head sent, its gone in the journal."""
    d.ctl.set_limit("keeper.work", ["2/h"], key="acme")
    d.ctl.checker.refresh_controls()
    d.ctl.lines.release(d.key)


def start(d: Deploy, task_id: str, headers: dict[str, Any], n: int) -> bool:
    """The pool's hook for one delivery of keeper.work("acme", n) with ``headers`` (only
    the throttle's header is read): True if its body would run."""
    headers = {HEADER: headers[HEADER]} if HEADER in headers else {}
    task = d.work._get_current_object()
    attach(task, d.ctl.checker.known(d.app, "keeper.work", None).spec)  # (as the worker's bootstep does)
    task.push_request(id=task_id, headers=headers, delivery_info={"redelivered": False}, is_eager=False,
                      called_directly=False, args=["acme", n], kwargs={}, **headers)
    try:
        return guard(task, ("acme", n), {})
    finally:
        task.pop_request()
