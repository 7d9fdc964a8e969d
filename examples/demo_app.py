"""The Celery app the demo's workers run (``celery -A examples.demo_app worker``).

Two tenants on different plans export reports, and two kinds of task share one external
API's limit. Every task body notes its start in Redis so the demo can show what ran.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

import celery_throttle
from celery_throttle import throttle

REDIS_URL = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("DEMO_PREFIX", "throttle-demo")

app = Celery("demo", broker=REDIS_URL)
app.conf.update(
    task_default_queue=f"{PREFIX}-tasks",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    throttle_key_prefix=PREFIX,
    # (each start the store counted, kept for the summary: `throttle simulate --export`)
    throttle_record=10_000,
)
celery_throttle.install(app)

PLANS = {"acme": "8/s", "globex": "3/s"}   # per-tenant quota, by plan
API_RATES = ("6/s", "40/m")                # the external API's limits, shared by two tasks

_records: redis.Redis | None = None


def _client() -> redis.Redis:
    global _records
    if _records is None:
        _records = redis.Redis.from_url(REDIS_URL)
    return _records


def note_start(stream: str) -> None:
    from celery import current_task

    started = time.time()
    _client().rpush(f"{PREFIX}:starts", json.dumps(
        {"stream": stream, "t": started, "id": current_task.request.id}))


@celery_throttle.signals.task_throttled.connect
def count_denial(sender, scope, key, **_):
    stream = "github-api" if scope == "github-api" else f"export:{key}"
    _client().hincrby(f"{PREFIX}:denials", stream, 1)


@app.task
@throttle(lambda tenant, report: PLANS[tenant], key="{tenant}", algorithm="sliding")
def export_report(tenant: str, report: int) -> None:
    note_start(f"export:{tenant}")


@app.task
@throttle(*API_RATES, scope="github-api")
def sync_issues(repo: str) -> None:
    note_start("github-api")


@app.task
@throttle(*API_RATES, scope="github-api")
def sync_pulls(repo: str) -> None:
    note_start("github-api")
