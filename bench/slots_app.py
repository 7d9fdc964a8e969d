"""The tasks module of section 14 (concurrency slots), as an application writes one: the
app, ``celery_throttle.install(app)``, a task with ``@throttle(concurrency=K, key=...)``.
Workers run it (``celery -A bench.slots_app worker``); the section's producer imports it
and calls ``.delay()`` (the app is never finalized there).

Configured from the environment: CB_BROKER (the section's own redis-server: broker and
throttle store, as for most users), CB_PREFIX (key prefix, and of the records), CB_QUEUE,
CB_SLOT_LEASE (``throttle_concurrency_lease``). Each body notes ``"<start> <end> <tenant>
<pid> <ppid>"`` in ``<prefix>:spans`` when it ends, and ``"<start> <tenant> <ppid>"`` in
``<prefix>:began`` when it starts.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

import celery_throttle
from celery_throttle import throttle

BROKER = os.environ.get("CB_BROKER", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("CB_PREFIX", "ct-slots")
#: Bodies of one tenant that may run at once.
K = 4

app = Celery("slotsapp", broker=BROKER)
app.conf.update(
    task_default_queue=os.environ.get("CB_QUEUE", f"{PREFIX}-q"),
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=1,
    throttle_key_prefix=PREFIX,
    throttle_concurrency_lease=float(os.environ.get("CB_SLOT_LEASE", "30")),
)
celery_throttle.install(app)

_client: tuple[int, redis.Redis] | None = None


def client() -> redis.Redis:
    """This process's Redis client for records (one per pool process, made after fork)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(BROKER))
    return _client[1]


def body(tenant: str, seconds: float) -> None:
    start = time.time()
    client().rpush(f"{PREFIX}:began", f"{start:.6f} {tenant} {os.getppid()}")
    time.sleep(seconds)
    client().rpush(f"{PREFIX}:spans", f"{start:.6f} {time.time():.6f} {tenant} {os.getpid()} {os.getppid()}")


@app.task
@throttle(concurrency=K, scope="export-api", key="{tenant}")
def export(tenant: str, seconds: float) -> None:
    body(tenant, seconds)


@app.task
@throttle(concurrency=1, scope="export-one", key="{tenant}")
def export_one(tenant: str, seconds: float) -> None:
    body(tenant, seconds)


@app.task
def plain(tenant: str, seconds: float) -> None:
    """The same body, not throttled: the baseline."""
    body(tenant, seconds)
