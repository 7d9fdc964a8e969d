"""The tasks module of section 12 (Redis per task), written the way an application writes
one: it creates the Celery app, calls ``celery_throttle.install(app)`` and defines its
tasks with ``@app.task`` over ``@throttle(...)``. Workers run it (``celery -A
bench.rpt_app worker``) and the producers only import it and call ``.delay()``
(bench/rpt_producer.py): nothing here finalizes the app.

Configured from the environment: CB_BROKER (broker URL; the section's own redis-server,
which is the throttle store too, as for most users), CB_PREFIX (throttle key prefix, and
the prefix of the few records kept), CB_QUEUE (the default queue), CB_CHECK_AT_PUBLISH
(``0`` turns ``throttle_check_at_publish`` off; unset: the default).

Each throttled task is there twice: ``@app.task`` over ``@throttle`` (the usual order), and
``@throttle`` over ``@app.task`` (``*_above``), which the decorator also documents.

The per-task rows' tasks do nothing. The noisy-neighbour and learning tasks note their
start as ``"<time> <task id>"`` in the list ``<prefix>:starts:<tenant>``; a worker notes
when it is ready in ``<prefix>:ready`` (a list: one entry per worker).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready

import celery_throttle
from celery_throttle import throttle

BROKER = os.environ.get("CB_BROKER", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("CB_PREFIX", "ct-rpt")
#: Far under the limit, and a quota spent before the run (per tenant).
UNDER = "1000000/s"
QUOTA = "100/h"
#: The same two for ``limits``, which spells them its own way.
LIMITS_UNDER = "1000000/second"
LIMITS_QUOTA = "100/hour"
#: The learning rows: a rate a burst of 10 fills.
LEARN = "10/s"

app = Celery("rptapp", broker=BROKER)
app.conf.update(
    task_default_queue=os.environ.get("CB_QUEUE", f"{PREFIX}-q"),
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    throttle_key_prefix=PREFIX,
)
if os.environ.get("CB_CHECK_AT_PUBLISH"):
    app.conf.throttle_check_at_publish = os.environ["CB_CHECK_AT_PUBLISH"] == "1"
celery_throttle.install(app)

_client: tuple[int, redis.Redis] | None = None


def client() -> redis.Redis:
    """This process's Redis client for records (one per pool process, made after fork)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(BROKER))
    return _client[1]


def record(tenant: str, task_id: str | None) -> None:
    client().rpush(f"{PREFIX}:starts:{tenant}", f"{time.time():.6f} {task_id}")


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    client().rpush(f"{PREFIX}:ready", f"{time.time():.6f}")


# -- per task: plain Celery, ours, and the peer (limits' moving window, by hand) --------
@app.task
def plain(tenant):
    pass


@app.task
@throttle(UNDER, key="{tenant}")
def ours_under(tenant):
    pass


@app.task
@throttle(QUOTA, key="{tenant}")
def ours_flood(tenant):
    pass


_limits: dict[str, Any] = {}


def moving_window() -> tuple[Any, Any]:
    """(limiter, storage) of ``limits``' moving window on the broker's Redis, per process."""
    if _limits.get("pid") != os.getpid():
        from limits.storage import RedisStorage
        from limits.strategies import MovingWindowRateLimiter

        storage = RedisStorage(BROKER, key_prefix=f"{PREFIX}-limits")
        _limits.update(pid=os.getpid(), limiter=MovingWindowRateLimiter(storage), storage=storage)
    return _limits["limiter"], _limits["storage"]


def _peer(task: Any, rate: str, tenant: str) -> None:
    """What a hand-written limit does: hit the window; denied, retry when it resets."""
    from limits import parse

    limiter, _ = moving_window()
    item = parse(rate)
    if not limiter.hit(item, tenant):
        reset = limiter.get_window_stats(item, tenant).reset_time
        raise task.retry(countdown=max(reset - time.time(), 1.0))


@app.task(bind=True, max_retries=None)
def peer_under(self, tenant):
    _peer(self, LIMITS_UNDER, tenant)


@app.task(bind=True, max_retries=None)
def peer_flood(self, tenant):
    _peer(self, LIMITS_QUOTA, tenant)


# -- noisy neighbour (prefilled queue) and learning: starts recorded --------------------
@app.task(bind=True)
@throttle(QUOTA, key="{tenant}")
def neighbour(self, tenant):
    record(tenant, self.request.id)


@app.task(bind=True)
@throttle(LEARN, key="{tenant}")
def learn(self, tenant):
    record(tenant, self.request.id)


# -- the same, with @throttle above @app.task (the other order the decorator documents) --
@throttle(UNDER, key="{tenant}")
@app.task
def ours_under_above(tenant):
    pass


@throttle(QUOTA, key="{tenant}")
@app.task
def ours_flood_above(tenant):
    pass


@throttle(QUOTA, key="{tenant}")
@app.task(bind=True)
def neighbour_above(self, tenant):
    record(tenant, self.request.id)


@throttle(LEARN, key="{tenant}")
@app.task(bind=True)
def learn_above(self, tenant):
    record(tenant, self.request.id)


# -- the prefilled neighbour with a task that does not take ``self`` (bind=False) -------
@app.task
@throttle(QUOTA, key="{tenant}")
def neighbour_unbound(tenant):
    from celery import current_task

    record(tenant, current_task.request.id)


@app.task
@throttle(LEARN, key="{tenant}")
def learn_unbound(tenant):
    from celery import current_task

    record(tenant, current_task.request.id)
