"""The API the ``api429`` section protects: Flask + Flask-Limiter, served by gunicorn.

``gunicorn bench.apiserver:app``, configured from the environment: CB_API_STRATEGY
(Flask-Limiter's ``moving-window`` or ``fixed-window``), CB_API_LIMIT (default
``10 per 1 second``), CB_API_JITTER_MS (each request waits a random 0 to this many ms
before the limiter sees it: a stand-in for the varying network and ingress delay
between a client and a remote API; default 0), CB_API_STORAGE (the limiter's Redis, shared by every gunicorn
worker so the limit is global), CB_API_KEY_PREFIX (the limiter's Redis keys start with
it), CB_STORE and CB_PREFIX (where the counts below go).

``GET /call/<account>?label=L&id=T`` answers 200, or 429 with ``Retry-After`` once the
account has had its limit. Each answer is counted server-side under its label:
``<prefix>:api:req:<L>`` (every request), ``<prefix>:api:429:<L>`` (429s) and
``<prefix>:api:arr:<L>`` (``"<arrival time> <status> <task id>"``, one per request).
``GET /health`` is not limited.
"""

from __future__ import annotations

import os
import random
import sys
import time

import redis
from flask import Flask, g, request
from flask_limiter import Limiter

PREFIX = os.environ.get("CB_PREFIX", "ct-bench")
STORE = os.environ.get("CB_STORE", "redis://127.0.0.1:6379/10")
STRATEGY = os.environ.get("CB_API_STRATEGY", "moving-window")
LIMIT = os.environ.get("CB_API_LIMIT", "10 per 1 second")
JITTER = float(os.environ.get("CB_API_JITTER_MS", "0")) / 1000

app = Flask(__name__)
records = redis.Redis.from_url(STORE)


@app.before_request
def _arrived() -> None:
    # Registered before Flask-Limiter's own check, so it runs first.
    if JITTER:
        time.sleep(random.uniform(0, JITTER))
    g.arrived = time.time()


limiter = Limiter(
    key_func=lambda: "-",
    app=app,
    storage_uri=os.environ.get("CB_API_STORAGE", "redis://127.0.0.1:6379/11"),
    storage_options={"key_prefix": os.environ.get("CB_API_KEY_PREFIX", f"{PREFIX}-api")},
    strategy=STRATEGY,
    headers_enabled=True,
)


def _account() -> str:
    return (request.view_args or {}).get("account", "-")


@app.get("/call/<account>")
@limiter.limit(LIMIT, key_func=_account)
def call(account: str) -> dict[str, str]:
    return {"account": account}


@app.get("/health")
@limiter.exempt
def health() -> str:
    return "ok"


@app.after_request
def _count(response):  # type: ignore[no-untyped-def]
    label = request.args.get("label")
    if label and request.endpoint == "call":
        pipe = records.pipeline(transaction=False)
        pipe.incr(f"{PREFIX}:api:req:{label}")
        if response.status_code == 429:
            pipe.incr(f"{PREFIX}:api:429:{label}")
        pipe.rpush(f"{PREFIX}:api:arr:{label}",
                   f"{g.get('arrived', time.time()):.6f} {response.status_code} {request.args.get('id', '-')}")
        pipe.execute()
    return response


# One line per gunicorn worker that has loaded the app: the bench waits for them all.
print(f"bench.apiserver loaded in {os.getpid()} ({STRATEGY}, {LIMIT}, jitter {JITTER * 1000:g} ms)",
      file=sys.stderr, flush=True)
