"""The Celery app the bench workers run (``celery -A bench.workerapp worker``).

Configured from the environment, so one module serves every worker group the bench
starts: CB_BROKER, CB_STORE (throttle store and records), CB_PREFIX (key prefix), CB_QUEUE
(the queue consumed at start), CB_RATE (the burst limit, e.g. "25/s"), CB_FAST_RATE (a
limit never reached, for the overhead run), CB_LONG_RATE (the long-wait quota),
CB_BACKLOG_RATE (the one key of the deep-backlog run), CB_NEIGHBOUR_RATE (each tenant's
quota in the noisy-neighbour run), CB_CHECK_AT_PUBLISH (``1``/``0``: sets
``throttle_check_at_publish``; unset: the default), CB_PARK_AFTER, CB_VISIBILITY (Redis
broker visibility timeout, seconds), CB_TRACE=1 (note every denial in
``<prefix>:denials:<label>``).

Every task body notes its start as ``"<time> <task id>"`` in the list
``<prefix>:starts:<label>`` (worker clock; the bench runs on one machine, where it is
Redis's clock too). Denials are counted in ``<prefix>:denied:<label>``: by the
``task_throttled`` signal for celery_throttle, by the task itself for the naive baselines.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

import celery_throttle
from bench.naive import NaiveLimiter
from celery_throttle import throttle
from celery_throttle.core.rates import parse_rate
from celery_throttle.signals import task_throttled

PREFIX = os.environ.get("CB_PREFIX", "ct-bench")
STORE = os.environ.get("CB_STORE", "redis://127.0.0.1:6379/10")
RATE = os.environ.get("CB_RATE", "25/s")
FAST_RATE = os.environ.get("CB_FAST_RATE", "1000000/s")
LONG_RATE = os.environ.get("CB_LONG_RATE", "100/20s")
BACKLOG_RATE = os.environ.get("CB_BACKLOG_RATE", "1/s")
NEIGHBOUR_RATE = os.environ.get("CB_NEIGHBOUR_RATE", "100/h")

app = Celery("benchapp", broker=os.environ.get("CB_BROKER", "redis://127.0.0.1:6379/11"))
_transport: dict[str, Any] = {}
if os.environ.get("CB_VISIBILITY"):
    _transport["visibility_timeout"] = float(os.environ["CB_VISIBILITY"])
app.conf.update(
    task_default_queue=os.environ.get("CB_QUEUE", f"{PREFIX}-idle"),
    broker_connection_retry_on_startup=True,
    broker_transport_options=_transport,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=int(os.environ.get("CB_PREFETCH", "4")),
    task_ignore_result=True,
    # CB_THROTTLE_STORE: the throttle's store alone elsewhere (the slow-store section puts
    # it behind a delaying proxy), the records staying on CB_STORE.
    throttle_redis_url=os.environ.get("CB_THROTTLE_STORE", STORE),
    throttle_key_prefix=PREFIX,
)
if os.environ.get("CB_CHECK_AT_PUBLISH"):
    app.conf.throttle_check_at_publish = os.environ["CB_CHECK_AT_PUBLISH"] == "1"
if os.environ.get("CB_PARK_AFTER"):
    app.conf.throttle_park_after = float(os.environ["CB_PARK_AFTER"])
    app.conf.throttle_release_interval = 0.5
ctl = celery_throttle.install(app)

_client: tuple[int, redis.Redis] | None = None
_naive: dict[str, NaiveLimiter] = {}


def client() -> redis.Redis:
    """This process's Redis client for records (one per pool process, made after fork)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(STORE))
        _naive.clear()
    return _client[1]


def record(label: str, task_id: str | None) -> None:
    client().rpush(f"{PREFIX}:starts:{label}", f"{time.time():.6f} {task_id}")


@task_throttled.connect
def _count_denial(sender: Any = None, request: Any = None, delay: float = 0.0, parked: bool = False,
                  **_: Any) -> None:
    args = getattr(request, "args", None) or []
    label = args[0] if args else (getattr(request, "kwargs", None) or {}).get("label", "?")
    pipe = client().pipeline(transaction=False)
    pipe.incr(f"{PREFIX}:denied:{label}")
    if os.environ.get("CB_TRACE") == "1":  # every denial: time, delay, task id
        pipe.rpush(f"{PREFIX}:denials:{label}", f"{time.time():.6f} {delay:.6f} {request.id}")
    if parked:
        pipe.incr(f"{PREFIX}:parked:{label}")
    pipe.execute()


# -- celery_throttle, at the burst rate -------------------------------------------------
@app.task(bind=True)
@throttle(RATE, key="{label}")
def sliding(self, label):
    record(label, self.request.id)


#: A second rate, of tokens, beside RATE (a call costs TOKENS_COST of them): rates of two
#: units, whose lease is of calls (bench.units_calls measures what a task costs).
TOKENS_RATE = os.environ.get("CB_TOKENS_RATE", "1000000000 tokens/s")
TOKENS_COST = 5


@app.task(bind=True)
@throttle(RATE, TOKENS_RATE, key="{label}", cost={"tokens": TOKENS_COST})
def sliding_tokens(self, label):
    record(label, self.request.id)


@app.task(bind=True)
@throttle(RATE, key="{label}", algorithm="fixed")
def fixed(self, label):
    record(label, self.request.id)


# -- Celery's own rate_limit (per worker) ----------------------------------------------
@app.task(bind=True, rate_limit=RATE)
def builtin(self, label):
    record(label, self.request.id)


# -- the hand-written baselines ----------------------------------------------------------
def _naive_task(task: Any, algorithm: str, label: str, rate_text: str = RATE) -> None:
    client()
    limiter = _naive.get(algorithm)
    if limiter is None:
        limiter = _naive[algorithm] = NaiveLimiter(client(), algorithm)
    rate = parse_rate(rate_text)
    allowed, wait = limiter.hit(f"{PREFIX}:naive-{algorithm}:{label}", rate.limit, rate.period,
                                member=f"{task.request.id}:{time.time()}")
    if not allowed:
        client().incr(f"{PREFIX}:denied:{label}")
        raise task.retry(countdown=wait)
    record(label, task.request.id)


# max_retries=None on the task: ``retry(max_retries=None)`` alone means "the default, 3".
@app.task(bind=True, max_retries=None)
def naive_fixed(self, label):
    _naive_task(self, "fixed", label)


@app.task(bind=True, max_retries=None)
def naive_sliding(self, label):
    _naive_task(self, "sliding", label)


# -- overhead: the same no-op, with and without a limit it never reaches ---------------
@app.task(bind=True)
def plain(self, label):
    record(label, self.request.id)


@app.task(bind=True)
@throttle(FAST_RATE, key="{label}")
def fast_sliding(self, label):
    record(label, self.request.id)


@app.task(bind=True)
@throttle(FAST_RATE, key="{label}", algorithm="fixed")
def fast_fixed(self, label):
    record(label, self.request.id)


# -- long waits: a spent quota ---------------------------------------------------------
@app.task(bind=True)
@throttle(LONG_RATE, key="{label}")
def long_wait(self, label):
    record(label, self.request.id)


# -- deep backlog: every call on one key -----------------------------------------------
@app.task(bind=True)
@throttle(BACKLOG_RATE, scope="bench-backlog")
def backlog(self, label):
    record(label, self.request.id)


# -- noisy neighbour: a quota per tenant (the label names the tenant) ------------------
@app.task(bind=True)
@throttle(NEIGHBOUR_RATE, key="{label}")
def neighbour(self, label):
    record(label, self.request.id)


@app.task(bind=True, max_retries=None)
def neighbour_naive(self, label):
    _naive_task(self, "sliding", label, NEIGHBOUR_RATE)
