"""The Celery app of the ``api429`` section (``celery -A bench.apiworker worker``).

Each task makes one HTTP request to the API of bench/apiserver.py (CB_API_URL), as a
user's task calling a rate-limited API would, and on a 429 retries itself with
``self.retry(countdown=...)``: the ``Retry-After`` the API sent, at least 1 s. The tasks
differ only in how the client limits itself: celery_throttle sliding at the published
limit, with a margin, at 9/s, fixed; Celery's own ``rate_limit``; nothing. The throttle's
key is the API account, as the API's limit is.

Configured from the environment like bench/workerapp.py: CB_BROKER, CB_STORE (throttle
store and records), CB_PREFIX, CB_QUEUE, CB_API_URL. Records (in CB_STORE):
``<prefix>:api:c429:<label>`` counts the 429s the tasks saw, ``<prefix>:api:err:<label>``
the requests that failed (retried after 1 s), and ``<prefix>:api:try:<label>`` holds
``"<time the request was made> <status> <task id>"`` for each request; a 200 adds
``"<time made> <time answered> <task id>"`` to ``<prefix>:api:done:<label>``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
import requests
from celery import Celery

import celery_throttle
from celery_throttle import throttle

PREFIX = os.environ.get("CB_PREFIX", "ct-bench")
STORE = os.environ.get("CB_STORE", "redis://127.0.0.1:6379/10")
API_URL = os.environ.get("CB_API_URL", "http://127.0.0.1:8000")
#: The API's published limit, and the client's rates against it.
RATE = "10/s"

app = Celery("benchapi", broker=os.environ.get("CB_BROKER", "redis://127.0.0.1:6379/11"))
app.conf.update(
    task_default_queue=os.environ.get("CB_QUEUE", f"{PREFIX}-api-idle"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
    throttle_redis_url=STORE,
    throttle_key_prefix=PREFIX,
)
ctl = celery_throttle.install(app)

_client: tuple[int, redis.Redis] | None = None


def client() -> redis.Redis:
    """This process's Redis client for records (one per pool process, made after fork)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(STORE))
    return _client[1]


def retry_after(response: requests.Response) -> float:
    """The API's ``Retry-After`` in seconds, at least 1 s (Flask-Limiter sends whole
    seconds, often 0 for a 1 s window); 1 s when absent or unreadable."""
    try:
        return max(float(response.headers.get("Retry-After", "1")), 1.0)
    except ValueError:
        return 1.0


def call_api(task: Any, label: str, account: str) -> None:
    """One request; a 429 (or a failed request) retries the task."""
    made = time.time()
    try:
        response = requests.get(f"{API_URL}/call/{account}", params={"label": label, "id": task.request.id},
                                timeout=10)
    except requests.RequestException as exc:
        client().incr(f"{PREFIX}:api:err:{label}")
        raise task.retry(countdown=1.0, exc=exc) from None
    answered = time.time()
    pipe = client().pipeline(transaction=False)
    pipe.rpush(f"{PREFIX}:api:try:{label}", f"{made:.6f} {response.status_code} {task.request.id}")
    if response.status_code == 429:
        pipe.incr(f"{PREFIX}:api:c429:{label}")
        pipe.execute()
        raise task.retry(countdown=retry_after(response))
    if response.status_code != 200:
        pipe.incr(f"{PREFIX}:api:err:{label}")
        pipe.execute()
        raise task.retry(countdown=1.0)
    pipe.rpush(f"{PREFIX}:api:done:{label}", f"{made:.6f} {answered:.6f} {task.request.id}")
    pipe.execute()


# max_retries=None on each task: a task retries on 429s as long as it takes.

@app.task(bind=True, max_retries=None)
@throttle(RATE, key="{account}")
def sliding(self, label, account):
    call_api(self, label, account)


@app.task(bind=True, max_retries=None)
@throttle(RATE, key="{account}", margin=0)
def margin_0(self, label, account):
    call_api(self, label, account)


@app.task(bind=True, max_retries=None)
@throttle(RATE, key="{account}", margin=0.05)
def margin_05(self, label, account):
    call_api(self, label, account)


@app.task(bind=True, max_retries=None)
@throttle(RATE, key="{account}", margin=0.1)
def margin_10(self, label, account):
    call_api(self, label, account)


@app.task(bind=True, max_retries=None)
@throttle("9/s", key="{account}")
def sliding_9(self, label, account):
    call_api(self, label, account)


@app.task(bind=True, max_retries=None)
@throttle(RATE, key="{account}", algorithm="fixed")
def fixed(self, label, account):
    call_api(self, label, account)


@app.task(bind=True, max_retries=None, rate_limit=RATE)
def builtin(self, label, account):
    call_api(self, label, account)


@app.task(bind=True, max_retries=None)
def plain(self, label, account):
    call_api(self, label, account)
