"""The bench's one Celery app (``celery -A bench.app worker``), and its producer.

Configured from the environment as tests/taskapp.py is (CT_BROKER, CT_STORE, CT_RECORDS, CT_PREFIX,
CT_QUEUE, CT_PREFETCH, CT_CHECK_AT_PUBLISH, CT_ACKS_LATE, CT_HAND_OFF, CT_JOURNAL, CT_SLOT_LEASE) and BENCH_RATE, BENCH_API_URL,
BENCH_DENIALS=1 (denials counted), BENCH_SHARER_PASSES=1 (sharer passes counted).
A body notes its start in ``<prefix>:starts:<label>`` (a slot's span in ``<prefix>:spans``).

``python -m bench.app '{"sends": [...]}'``: a producer as users write one (imports this module, never
finalizes the app). A send: ``task``, ``args``, ``count``, ``queue``, ``pace`` (s between calls), ``vary``
(``"index"`` or a list, inserted at ``vary_at``), ``pooled`` (one producer for all), ``ids``. Prints
one JSON line: per send, its first and last call's time and (``ids``) each call's id and time.
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import redis
from celery import Celery

import celery_throttle
from celery_throttle import Backoff, throttle
from celery_throttle.core.rates import parse_rate
from celery_throttle.signals import task_throttled

PREFIX = os.environ.get("CT_PREFIX", "ct-bench")
STORE = os.environ.get("CT_STORE", "redis://127.0.0.1:6379/0")
RECORDS = os.environ.get("CT_RECORDS", STORE)
RATE = os.environ.get("BENCH_RATE", "25/s")
API_URL = os.environ.get("BENCH_API_URL", "http://127.0.0.1:8000")
#: A tenant's quota (spent before a flood), and a limit never reached.
QUOTA, UNDER = "100/h", "1000000/s"


@dataclass(frozen=True)
class Plan:
    """An LLM API account: ``requests`` and ``tokens`` in any ``window`` s; call ``i`` uses its prompt's
    tokens (known to the client) and its completion's (from the reply), drawn from ``i`` alone."""

    requests: int
    tokens: int
    window: float
    prompt: tuple[int, int]
    completion: tuple[int, int]
    seed: str

    def prompt_tokens(self, i: int) -> int:
        low, high = self.prompt
        return random.Random(f"{self.seed}:prompt:{i}").randint(low, high)

    def cost(self, i: int) -> int:
        """The tokens call ``i`` uses, as the API counts them."""
        return self.prompt_tokens(i) + random.Random(f"{self.seed}:{i}").randint(*self.completion)

    def total(self, calls: int) -> int:
        return sum(self.cost(i) for i in range(calls))


#: Section 15b: 20 requests and 4 000 tokens per 10 s, prompts of 50..250, replies of 20..200.
SWEEP_PLAN = Plan(20, 4_000, 10.0, (50, 250), (20, 200), "bench-llm-26")
SWEEP_RATES, MAX_COMPLETION = ("20/10s", "4000 tokens/10s"), 200

app = Celery("bench", broker=os.environ.get("CT_BROKER", "redis://127.0.0.1:6379/1"))
app.conf.update(task_default_queue=os.environ.get("CT_QUEUE", f"{PREFIX}-q"), broker_connection_retry_on_startup=True,
                worker_hijack_root_logger=False, task_ignore_result=True,
                worker_prefetch_multiplier=int(os.environ.get("CT_PREFETCH", "4")), throttle_redis_url=STORE,
                throttle_key_prefix=PREFIX, throttle_concurrency_lease=float(os.environ.get("CT_SLOT_LEASE", "30")),
                throttle_record=int(os.environ.get("CT_RECORD", "0")),
                throttle_mode=os.environ.get("CT_MODE", "enforce"))
if "CT_CHECK_AT_PUBLISH" in os.environ:
    app.conf.throttle_check_at_publish = os.environ["CT_CHECK_AT_PUBLISH"] == "1"
if "CT_ACKS_LATE" in os.environ:
    app.conf.task_acks_late = os.environ["CT_ACKS_LATE"] == "1"
if "CT_HAND_OFF" in os.environ:
    app.conf.throttle_hand_off = os.environ["CT_HAND_OFF"] == "1"
if "CT_JOURNAL" in os.environ:
    app.conf.throttle_journal = os.environ["CT_JOURNAL"] == "1"
ctl = celery_throttle.install(app)


@functools.cache
def _per_process(what: str, pid: int) -> Any:
    """This process's client for the notes, or ``limits``' moving window on the store (keys under
    ``<prefix>-limits``): one per pool process, made after the fork."""
    if what == "records":
        return redis.Redis.from_url(RECORDS)
    from limits import storage, strategies

    return strategies.MovingWindowRateLimiter(storage.RedisStorage(STORE, key_prefix=f"{PREFIX}-limits"))


def records() -> redis.Redis:
    return _per_process("records", os.getpid())


def record(label: str, task_id: str | None) -> None:
    now = time.time()
    records().rpush(f"{PREFIX}:starts:{label}", json.dumps({"label": label, "id": task_id, "t": now}))


@task_throttled.connect
def _denied(sender: Any = None, request: Any = None, **_: Any) -> None:
    if os.environ.get("BENCH_DENIALS") == "1":
        args = getattr(request, "args", None) or [(getattr(request, "kwargs", None) or {}).get("label", "?")]
        records().incr(f"{PREFIX}:denied:{args[0]}")


if os.environ.get("BENCH_SHARER_PASSES") == "1":
    from celery_throttle.waits.sharer import Sharer

    _share_pass = Sharer.share

    def _counted_pass(self: Sharer, scope: str, total: int) -> tuple[dict[str, int], list[str]]:
        records().incr(f"{PREFIX}:passes:{scope}")
        return _share_pass(self, scope, total)

    Sharer.share = _counted_pass  # type: ignore[method-assign]


def _task(name: str, fn: Any = None, *rates: Any, options: dict[str, Any] | None = None, **limits: Any) -> None:
    """``fn`` (default: note the start of ``label``) as the task ``bench.app.<name>``, under
    ``@throttle(*rates, **limits)`` when given. ``max_retries=None``: a task that retries itself
    does so as long as it takes (``retry(max_retries=None)`` alone means the default, 3)."""
    fn = fn or (lambda self, label: record(label, self.request.id))
    fn.__name__ = fn.__qualname__ = name  # (Celery builds a signature check named after it)
    if rates or limits:
        fn = throttle(*rates, **limits)(fn)
    globals()[name] = app.task(bind=True, name=f"bench.app.{name}", max_retries=None, **(options or {}))(fn)


# -- the burst (1-4), the slow store (13), the noisy neighbour (10): a key per label -----------
for _name, _rates, _limits in (("sliding", (RATE,), {}), ("fixed", (RATE,), {"algorithm": "fixed"}),
                               ("neighbour", (QUOTA,), {})):
    _task(_name, None, *_rates, key="{label}", **_limits)
_task("builtin", options={"rate_limit": RATE})
_task("plain")

#: The naive baselines: the seed's fixed-window INCR counter, and the usual sorted-set log.
#: ARGV: limit, window (ms)[, a unique member]; they answer {allowed, ms until it opens}.
NAIVE = {"fixed": """local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = math.floor(now / window)
local current = redis.call('INCR', KEYS[1] .. ':' .. w)
if current == 1 then redis.call('PEXPIRE', KEYS[1] .. ':' .. w, window) end
if current > limit then return {0, (w + 1) * window - now} end
return {1, 0}""", "sliding": """local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], window)
  return {1, 0}
end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, math.ceil(tonumber(oldest[2]) + window - now)}"""}


def _naive(algorithm: str, rate_text: str) -> Any:
    rate = parse_rate(rate_text)

    def task(self: Any, label: str) -> None:
        script = records().register_script(NAIVE[algorithm])
        allowed, wait_ms = script(keys=[f"{PREFIX}:naive-{algorithm}:{label}"],
                                  args=[rate.limit, round(rate.period * 1000), f"{self.request.id}:{time.time()}"])
        if not int(allowed):
            records().incr(f"{PREFIX}:denied:{label}")
            raise self.retry(countdown=max(int(wait_ms), 0) / 1000)
        record(label, self.request.id)
    return task


for _name, _algorithm, _rate in (("naive_fixed", "fixed", RATE), ("naive_sliding", "sliding", RATE),
                                 ("neighbour_naive", "sliding", QUOTA)):
    _task(_name, _naive(_algorithm, _rate))


# -- the API clients (11): one request each; a 429 retried after Retry-After ---------------
def request(path: str, **query: Any) -> tuple[int, dict[str, Any], float]:
    """(status, JSON body, Retry-After in s, at least 1) of one GET to the bench's API."""
    return fetch(path, **query)[:3]  # type: ignore[return-value]


def fetch(path: str, **query: Any) -> tuple[int, dict[str, Any], float, Any]:
    """:func:`request`, and the reply's headers."""
    try:
        with urllib.request.urlopen(f"{API_URL}{path}?{urllib.parse.urlencode(query)}", timeout=30) as reply:
            return reply.status, json.load(reply), 0.0, reply.headers
    except urllib.error.HTTPError as exc:
        try:
            wait = max(float(exc.headers.get("Retry-After", "1")), 1.0)
        except ValueError:
            wait = 1.0
        return exc.code, {}, wait, exc.headers


def _api(backoff: bool = False) -> Any:
    """One request (``i``: the call's index, for the API's log); a refusal (429, 503) retried after
    its Retry-After (1 s when it gives none), or (``backoff``) raised as ``Backoff`` with the header
    as the README writes it (none when the API gives none)."""
    def task(self: Any, label: str, account: str, i: int = -1) -> None:
        status, _, wait, headers = fetch("/call", account=account, label=label, id=self.request.id, i=i)
        if status != 200:
            if backoff:
                raise Backoff(retry_after=headers.get("Retry-After"))
            raise self.retry(countdown=wait or 1.0)
    return task


for _name, _rates, _limits, _options in (
        ("api_sliding", ("10/s",), {}, {}), ("api_fixed", ("10/s",), {"algorithm": "fixed"}, {}),
        ("api_builtin", (), {}, {"rate_limit": "10/s"}), ("api_plain", (), {}, {})):
    _task(_name, _api(), *_rates, options=_options, **({"key": "{account}", **_limits} if _rates else {}))


# -- adaptive limits (16): an API whose limit moves, unknown to the client ------------------
#: The API's documented ceiling, above every limit it enforces; the oracle starts at the first.
ADAPT_CEILING, ADAPT_FIRST = "100/s", "50/s"
_task("adapt_learning", _api(backoff=True), ADAPT_CEILING, adapt=True)
_task("adapt_backoff", _api(backoff=True), ADAPT_CEILING)
_task("adapt_oracle", _api(backoff=True), ADAPT_FIRST)  # (its limit set by the bench at each change)
_task("adapt_builtin", _api(), options={"rate_limit": "50/s"})  # (per worker: 100/s for 2)


# -- Redis per task (12): bodies that do nothing, over ten tenants --------------------------
def moving_window() -> Any:
    return _per_process("limits", os.getpid())


def _peer(rate: str) -> Any:
    """What a hand-written limit does: hit ``limits``' moving window; denied, retry at its reset."""
    def task(self: Any, tenant: str) -> None:
        from limits import parse

        item = parse(rate.replace("/s", "/second").replace("/h", "/hour"))
        if not moving_window().hit(item, tenant):
            raise self.retry(countdown=max(moving_window().get_window_stats(item, tenant).reset_time - time.time(), 1))
    return task


_task("rpt_plain", lambda self, tenant: None)
_task("rpt_under", lambda self, tenant: None, UNDER, key="{tenant}")
_task("rpt_flood", lambda self, tenant: None, QUOTA, key="{tenant}")
_task("rpt_peer_under", _peer(UNDER))
_task("rpt_peer_flood", _peer(QUOTA))

#: Many keys at their limit (bench/many_keys.py, issue 47): each tenant's tasks at once, against 5/s each;
#: each start noted under the label "keys", with its tenant for its id.
MANY_KEYS_RATE = "5/s"
_task("keys_plain", lambda self, tenant: record("keys", tenant))
_task("keys_limit", lambda self, tenant: record("keys", tenant), MANY_KEYS_RATE, key="{tenant}")

#: The journal's price (bench/journal.py, which spends each tenant's window first): notes its start.
JOURNAL_RATE = "50/5s"
_task("journal_wait", None, JOURNAL_RATE, key="{label}")


# -- a fair share of a scope's slots (17): K=8 for the scope, "heavy" weighing 2, the others 1 --
def _slot() -> Any:
    """A body of ``seconds``: its start noted, then its span with its task id and worker."""
    def task(self: Any, tenant: str, seconds: float) -> None:
        start = time.time()
        records().rpush(f"{PREFIX}:began", f"{start:.6f} {tenant} {os.getppid()}")
        time.sleep(seconds)
        records().rpush(f"{PREFIX}:spans", f"{start:.6f} {time.time():.6f} {tenant} {self.request.id} {os.getppid()}")
    return task


SHARE_K, SHARE_SCOPE, SHARE_WEIGHTS, PER_KEY = 8, "share-api", {"heavy": 2}, 3
_task("share_fair", _slot(), concurrency=SHARE_K, scope=SHARE_SCOPE, key="{tenant}",
      share=celery_throttle.Share(weight=lambda tenant, seconds: SHARE_WEIGHTS.get(tenant, 1)))
_task("share_per_key", _slot(), concurrency=PER_KEY, scope="share-per-key", key="{tenant}")
_task("share_plain", _slot())
#: Many small tenants beside a flood (bench/tenants.py, issue 46's shape): 6 slots over the scope,
#: shared; beside it, 2 per key and no share.
TENANTS_K, TENANTS_PER_KEY = 6, 2
_task("tenants_fair", _slot(), concurrency=TENANTS_K, scope="tenants-api", key="{tenant}", share=True)
_task("tenants_per_key", _slot(), concurrency=TENANTS_PER_KEY, scope="tenants-per-key", key="{tenant}")


# -- the LLM API (15b): requests and tokens ------------------------------------------------
def sweep_estimate(label: str, account: str, i: int) -> int:
    """15b's estimate: the prompt's tokens, known before the call, and the most a reply uses."""
    return SWEEP_PLAN.prompt_tokens(i) + MAX_COMPLETION


def sweep_mean(label: str, account: str, i: int) -> int:
    """An estimate of a reply's mean: the prompt's tokens and half the most a reply uses."""
    return SWEEP_PLAN.prompt_tokens(i) + MAX_COMPLETION // 2


def _llm(settle: bool = False, by_hand: bool = False, observe: bool = False) -> Any:
    """One call. ``settle``: ``charge(tokens=n)`` (0 for a 429) and a 429 raises ``Backoff`` (the
    README's example); ``by_hand``: ``limits``' moving window first (:func:`_by_hand`); ``observe``:
    every reply's rate-limit headers brought to the key (``observe(reply)``)."""
    def task(self: Any, label: str, account: str, i: int) -> None:
        if by_hand and (wait := _by_hand(account, sweep_estimate(label, account, i))):
            raise self.retry(countdown=wait)
        sent = time.monotonic()
        status, body, wait, headers = fetch("/v1/complete", account=account, label=label, i=i, id=self.request.id)
        # (what requests' response.elapsed says: from the send to the reply's headers)
        reply = SimpleNamespace(headers=headers, elapsed=timedelta(seconds=time.monotonic() - sent))
        if status == 429:
            if settle:
                celery_throttle.charge(tokens=0)
                if observe:
                    celery_throttle.observe(reply)
                raise Backoff(retry_after=wait)
            raise self.retry(countdown=wait)
        if settle:
            celery_throttle.charge(tokens=int(body["tokens"]))
            if observe:
                celery_throttle.observe(reply)
    return task


def _by_hand(account: str, estimate: int) -> float:
    """Both limits tested, then the tokens (the estimate) and the request taken: 0, or the
    seconds until the refusing limit's oldest entry leaves its window."""
    from limits import RateLimitItemPerSecond

    lim, calls, tokens = moving_window(), RateLimitItemPerSecond(20, 10), RateLimitItemPerSecond(4000, 10)
    refused = None
    if not lim.test(calls, account):
        refused = calls
    elif not lim.test(tokens, account, cost=estimate) or not lim.hit(tokens, account, cost=estimate):
        refused = tokens
    elif not lim.hit(calls, account):  # (the tokens stay taken: limits gives none back)
        refused = calls
    return 0.0 if refused is None else max(0.05, lim.get_window_stats(refused, account).reset_time - time.time())


_task("prompt_settled", _llm(settle=True), *SWEEP_RATES, key="{account}", cost={"tokens": sweep_estimate})
_task("mean_settled", _llm(settle=True), *SWEEP_RATES, key="{account}", cost={"tokens": sweep_mean})
_task("mean_observed", _llm(settle=True, observe=True), *SWEEP_RATES, key="{account}", cost={"tokens": sweep_mean})
_task("builtin_10s", _llm(), options={"rate_limit": "1/s"})
_task("by_hand", _llm(by_hand=True))


def produce(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for send in plan["sends"]:
        task, vary, pace = globals()[send["task"]], send.get("vary"), send.get("pace", 0.0)
        ids, times, first = [], [], time.time()
        with app.producer_or_acquire() as pub:
            for i in range(send.get("count", 1)):
                if pace:
                    time.sleep(max(0.0, first + i * pace - time.time()))
                # ("runs": each of vary's values that many times in a row, as a tenant sends its tasks at once)
                at_ = i // send.get("runs", 1)
                more = [i] if vary == "index" else [vary[at_ % len(vary)]] if vary else []
                args = list(send.get("args", []))
                where = send.get("vary_at", len(args))
                args[where:where] = more
                at = time.time()
                task_id = task.apply_async(tuple(args), queue=send.get("queue"),
                                           **({"producer": pub} if send.get("pooled") else {})).id
                if send.get("ids"):
                    ids.append(task_id)
                    times.append(at)
        out.append({"first": first, "last": time.time(), "ids": ids, "times": times})
    return out


if __name__ == "__main__":
    # (the sends as the argument, or on stdin: "-", for sends too long for a command line)
    spec = json.loads(sys.stdin.read() if sys.argv[1] == "-" else sys.argv[1])
    print(json.dumps({"sends": produce(spec), "finalized": app.finalized}), flush=True)
