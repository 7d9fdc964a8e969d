"""The Celery app of sections 15 and 15b (``celery -A bench.llmworker worker``): calls to the
fake LLM API of bench/llmapi.py, 60 requests and 10 000 tokens per minute per account
(section 15), or 20 requests and 4 000 tokens per 10 s (15b, issue 26).

Every task makes one call (CB_API_URL) and, on a 429, retries itself with
``self.retry(countdown=Retry-After)``, as a user's task would (one body, :func:`call`). They
differ only in how the client limits itself, keyed by the API account as the API's limit is:

* ``estimate``: ``@throttle("60/m", "10000 tokens/m", cost={"tokens": 250})``, the mean
  of the draw, never settled;
* ``estimate_max``: the same at 450 tokens, the most a call can use, never settled;
* ``settled``: estimated at 450, then ``charge(tokens=n)`` with the tokens the API
  reported (0 for a 429: the API counted none);
* ``estimate_settled``: estimated at the mean (250), then settled as ``settled`` is;
* ``builtin``: Celery's ``rate_limit="30/m"``, per worker: two workers send 60/m, as a
  user dividing the API's limit by the workers would; it knows nothing of tokens.

Section 15b's three, at 20 requests and 4 000 tokens per 10 s, a call's estimate its
prompt's tokens (known before the call, :meth:`~bench.llmapi.Plan.prompt_tokens`) + 200,
the most its completion may use:

* ``prompt_settled``: ``@throttle("20/10s", "4000 tokens/10s", cost={"tokens": prompt +
  200})``, settled with ``charge(tokens=n)``; a 429 as the README's example takes it,
  ``charge(tokens=0)`` and ``Backoff(retry_after=...)``;
* ``builtin_10s``: Celery's ``rate_limit="1/s"`` per worker (20 per 10 s over two);
* ``by_hand``: the ``limits`` library's moving window on the run's Redis, checked by hand
  before the call: both limits tested, then the tokens (the estimate) and the request
  taken, each atomically; refused, the task retries when the refusing limit's oldest
  entry leaves its window. A 429 is retried on ``Retry-After`` by all three but the first.

Configured from the environment: CB_BROKER (the run's own redis-server: broker and
throttle store), CB_PREFIX (key prefix), CB_QUEUE, CB_API_URL. The producer
(bench/llm_producer.py) imports this module configured the same way.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from celery import Celery

import celery_throttle
from bench.llmapi import MAX_COMPLETION, PLAN26
from celery_throttle import Backoff, throttle

BROKER = os.environ.get("CB_BROKER", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("CB_PREFIX", "ct-llm")
API_URL = os.environ.get("CB_API_URL", "http://127.0.0.1:8000")
RATES = ("60/m", "10000 tokens/m")
MEAN, MOST = 250, 450
RATES26 = (f"{PLAN26.requests}/{PLAN26.window:g}s", f"{PLAN26.tokens} tokens/{PLAN26.window:g}s")

app = Celery("benchllm", broker=BROKER)
app.conf.update(
    task_default_queue=os.environ.get("CB_QUEUE", f"{PREFIX}-q"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
    throttle_redis_url=BROKER,
    throttle_key_prefix=PREFIX,
)
if os.environ.get("CB_START_GRACE"):  # (how late a reserved start may still be used)
    app.conf.throttle_start_grace = float(os.environ["CB_START_GRACE"])
celery_throttle.install(app)


class RateLimited(Exception):
    def __init__(self, retry_after: float) -> None:
        super().__init__(f"429, retry after {retry_after:g} s")
        self.retry_after = retry_after


def complete(task: Any, label: str, account: str, i: int) -> int:
    """One call to the API; the tokens it reports, or :class:`RateLimited`."""
    query = urllib.parse.urlencode({"account": account, "label": label, "i": i, "id": task.request.id})
    try:
        with urllib.request.urlopen(f"{API_URL}/v1/complete?{query}", timeout=30) as reply:
            return int(json.load(reply)["tokens"])
    except urllib.error.HTTPError as exc:
        if exc.code != 429:
            raise
        try:
            wait = max(float(exc.headers.get("Retry-After", "1")), 1.0)
        except ValueError:
            wait = 1.0
        raise RateLimited(wait) from None


def call(task: Any, label: str, account: str, i: int, settle: bool = False, backoff: bool = False) -> None:
    """The body of every task: one call, a 429 retried ``Retry-After`` later. ``settle``:
    report the tokens the API counted with ``charge(tokens=n)`` (0 for a 429). ``backoff``:
    a 429 raises ``Backoff`` (the scope paused, the task run after the pause) instead."""
    try:
        used = complete(task, label, account, i)
    except RateLimited as exc:
        if settle:
            celery_throttle.charge(tokens=0)
        if backoff:
            raise Backoff(retry_after=exc.retry_after) from None
        raise task.retry(countdown=exc.retry_after) from None
    if settle:
        celery_throttle.charge(tokens=used)


# The tasks differ only in how they limit themselves (the decorators); max_retries=None on
# each: a task retries on 429s as long as it takes.

@app.task(bind=True, max_retries=None)
@throttle(*RATES, key="{account}", cost={"tokens": MEAN})
def estimate(self, label, account, i):
    call(self, label, account, i)


@app.task(bind=True, max_retries=None)
@throttle(*RATES, key="{account}", cost={"tokens": MOST})
def estimate_max(self, label, account, i):
    call(self, label, account, i)


@app.task(bind=True, max_retries=None)
@throttle(*RATES, key="{account}", cost={"tokens": MOST})
def settled(self, label, account, i):
    call(self, label, account, i, settle=True)


@app.task(bind=True, max_retries=None)
@throttle(*RATES, key="{account}", cost={"tokens": MEAN})
def estimate_settled(self, label, account, i):
    call(self, label, account, i, settle=True)


@app.task(bind=True, max_retries=None, rate_limit="30/m")
def builtin(self, label, account, i):
    call(self, label, account, i)


# -- section 15b: 20 requests and 4 000 tokens per 10 s, an estimate of prompt + 200 ----------

def estimate26(label: str, account: str, i: int) -> int:
    """The prompt's tokens, known before the call, and the most a completion may use."""
    return PLAN26.prompt_tokens(i) + MAX_COMPLETION


@app.task(bind=True, max_retries=None)
@throttle(*RATES26, key="{account}", cost={"tokens": estimate26})
def prompt_settled(self, label, account, i):
    call(self, label, account, i, settle=True, backoff=True)


@app.task(bind=True, max_retries=None, rate_limit="1/s")
def builtin_10s(self, label, account, i):
    call(self, label, account, i)


_limiter: Any = None


def limiter() -> Any:
    """This pool process's moving-window limiter on the run's Redis (made after the fork)."""
    global _limiter
    if _limiter is None:
        from limits import storage, strategies

        _limiter = strategies.MovingWindowRateLimiter(storage.storage_from_string(BROKER))
    return _limiter


def _limits26() -> tuple[Any, Any]:
    from limits import RateLimitItemPerSecond

    window = int(PLAN26.window)
    return RateLimitItemPerSecond(PLAN26.requests, window), RateLimitItemPerSecond(PLAN26.tokens, window)


@app.task(bind=True, max_retries=None)
def by_hand(self, label, account, i):
    lim, (requests, tokens) = limiter(), _limits26()
    estimate = estimate26(label, account, i)
    refused = None
    if not lim.test(requests, account):
        refused = requests
    elif not lim.test(tokens, account, cost=estimate) or not lim.hit(tokens, account, cost=estimate):
        refused = tokens
    elif not lim.hit(requests, account):  # (the tokens stay taken: limits gives none back)
        refused = requests
    if refused is not None:
        reset = lim.get_window_stats(refused, account).reset_time
        raise self.retry(countdown=max(0.05, reset - time.time()))
    call(self, label, account, i)
