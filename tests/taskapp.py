"""The Celery app the test workers run (``celery -A tests.taskapp worker``).

Configured from the environment so one module serves every worker a test starts:
CT_BROKER, CT_STORE (throttle_redis_url), CT_STORE_OPTIONS (JSON), CT_PREFIX (key prefix; also where starts are
recorded), CT_QUEUE, CT_ON_STORE_ERROR, CT_ACKS_LATE, CT_CONFIRM_PUBLISH, CT_TASK_SLEEP,
CT_CLOCK_SKEW (seconds this worker's clock is off, to record true start times),
CT_CHECK_AT_PUBLISH (0: a producer sends unchecked, the workers check), CT_METRICS_PORT (the
worker serves its metrics there; with PROMETHEUS_MULTIPROC_DIR, its pool processes' too).
Each task body records its start (worker clock) in Redis for the test to read.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from types import SimpleNamespace

import redis
from celery import Celery, shared_task
from celery.signals import task_postrun, task_prerun, worker_process_init

import celery_throttle
from celery_throttle import throttle
from celery_throttle.core.timing import CONTROL_REFRESH

PREFIX = os.environ.get("CT_PREFIX", "ct-test")
QUEUE = os.environ.get("CT_QUEUE", "ct-test")
REDIS = os.environ.get("CT_REDIS", "redis://127.0.0.1:6379")
STORE = os.environ.get("CT_STORE", f"{REDIS}/12")
RECORDS = os.environ.get("CT_RECORDS", f"{REDIS}/12")

app = Celery("taskapp", broker=os.environ.get("CT_BROKER", f"{REDIS}/13"),
             backend=os.environ.get("CT_BACKEND", f"{REDIS}/13"))
if "CT_PREFIX" in os.environ:
    # (a test's results under its prefix, so that its clean-up finds each one: a chord's
    # counters, the tasks a producer sent, whoever wrote them)
    app.conf.result_backend_transport_options = {"global_keyprefix": f"{PREFIX}:results:"}
app.conf.update(
    result_expires=600,
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_acks_late=os.environ.get("CT_ACKS_LATE") == "1",
    task_reject_on_worker_lost=os.environ.get("CT_ACKS_LATE") == "1",
    worker_prefetch_multiplier=int(os.environ.get("CT_PREFETCH", "4")),
    throttle_redis_url=STORE,
    throttle_redis_options=json.loads(os.environ.get("CT_STORE_OPTIONS", "{}")),
    throttle_key_prefix=PREFIX,
    throttle_on_store_error=os.environ.get("CT_ON_STORE_ERROR", "defer"),
    throttle_store_retry_delay=0.5,
    throttle_store_retry_max_delay=2.0,
    throttle_release_interval=0.5,
    throttle_record=int(os.environ.get("CT_RECORD", "0")),
    throttle_concurrency_lease=float(os.environ.get("CT_SLOT_LEASE", "30")),
    throttle_enabled=os.environ.get("CT_ENABLED", "1") == "1",
    throttle_check_at_publish=os.environ.get("CT_CHECK_AT_PUBLISH", "1") == "1",
    throttle_rules={
        # First match wins: the specific name before the glob.
        "tests.taskapp.unowned_fixed": {"rate": ["3/s"], "algorithm": "fixed"},
        "tests.taskapp.unowned_pub": {"rate": "3/10s", "key": "{tenant}"},
        "tests.taskapp.unowned_*": {"rate": "4/s", "key": "{tenant}"},
    },
)
# A gevent or eventlet worker acks each message from the greenlet that runs it, on a
# connection of the consumer's broker channel: kombu's Redis transport allows 10 at once,
# so -c 20 needs more ("Couldn't ack ... MaxConnectionsError" otherwise).
if os.environ.get("CT_BROKER_MAX_CONNECTIONS"):
    app.conf.broker_transport_options = {"max_connections": int(os.environ["CT_BROKER_MAX_CONNECTIONS"])}
# RabbitMQ's publisher confirms (CT_CONFIRM_PUBLISH=1): a publish the broker refuses raises
# in the sender, as users who must not lose a message configure it.
if os.environ.get("CT_CONFIRM_PUBLISH") == "1":
    app.conf.broker_transport_options = {"confirm_publish": True}
# A Redis broker's visibility timeout (CT_VISIBILITY, seconds): how long a message taken and
# not acked (a worker that lost its broker) waits before the broker gives it out again.
if os.environ.get("CT_VISIBILITY"):
    app.conf.broker_transport_options = {"visibility_timeout": float(os.environ["CT_VISIBILITY"])}
ctl = celery_throttle.install(app)

# The worker's metrics on CT_METRICS_PORT, as docs/operations.md tells users to serve them:
# from the worker's main process, and with prefork in prometheus-client's multiprocess mode
# (PROMETHEUS_MULTIPROC_DIR, set before the worker starts), its pool processes' summed in.
if os.environ.get("CT_METRICS_PORT"):
    from celery.signals import worker_init, worker_process_shutdown

    @worker_init.connect
    def _serve_metrics(**_):
        import prometheus_client
        from prometheus_client import multiprocess

        registry = prometheus_client.REGISTRY
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = prometheus_client.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        prometheus_client.start_http_server(int(os.environ["CT_METRICS_PORT"]), addr="127.0.0.1", registry=registry)

    @worker_process_shutdown.connect
    def _metrics_of_a_process_gone(pid, **_):
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid)  # (its live gauges: the slots it held)

_records = None


def _records_client() -> redis.Redis:
    global _records
    if _records is None:
        _records = redis.Redis.from_url(RECORDS)
    return _records


# Only workers started by a test (which sets CT_PREFIX) note what they see: a test process
# that imports this module (a producer sending these tasks) keeps its denials to itself.
_NOTING = "CT_PREFIX" in os.environ and not os.environ.get("CT_PRODUCER")


def _note(what: str, sender, request, **fields) -> None:
    if _NOTING:
        _records_client().rpush(f"{PREFIX}:{what}", json.dumps({"task": sender.name, "id": request.id, **fields}))


@celery_throttle.signals.task_throttled.connect
def _note_denial(sender, request, delay, scope, key, reason=None, **_):
    _note("throttled", sender, request, delay=delay, scope=scope, key=key, reason=reason)


@celery_throttle.signals.task_shadow_throttled.connect
def _note_shadowed(sender, request, delay, scope, key, reason, **_):
    _note("shadowed", sender, request, delay=delay, scope=scope, key=key, reason=reason, t=time.time())


@worker_process_init.connect
def _connect_early(**_):
    # Connected before the first task: the notes below run between a task's admission and
    # its body, and a first connection there would make that start look late.
    if _NOTING:
        _records_client().ping()


@task_prerun.connect
def _note_prerun(sender, task_id, **_):
    _note_id("prerun", sender, task_id)


@task_postrun.connect
def _note_postrun(sender, task_id, state, **_):
    _note_id("postrun", sender, task_id, state=state)


def _note_id(what: str, sender, task_id: str, **fields) -> None:
    # Only for the task the signal test sends: a note costs a round trip between a task's
    # admission and its body, which would blur every other test's start times.
    if _NOTING and sender.name == "tests.taskapp.signalled":
        _records_client().rpush(f"{PREFIX}:{what}", json.dumps({"task": sender.name, "id": task_id, **fields}))


@celery_throttle.signals.task_wait_exceeded.connect
def _note_gave_up(sender, request, wait, max_wait, scope, key, **_):
    _note("gave-up", sender, request, wait=wait, max_wait=max_wait, scope=scope, key=key)


def record(label: str, **extra) -> None:
    """Note one start of a task body, with the worker's clock."""
    from celery import current_task

    req = current_task.request
    # A worker run with a skewed clock (libfaketime) is told its skew, so that starts
    # are compared on one true clock; read first, before any I/O.
    now = time.time() - float(os.environ.get("CT_CLOCK_SKEW", "0"))
    entry = {"label": label, "id": req.id, "t": now, "retries": req.retries,
             "pid": os.getpid(), "queue": (req.delivery_info or {}).get("routing_key"),
             "app_id": (req.properties or {}).get("app_id"), **extra}
    _records_client().rpush(f"{PREFIX}:starts", json.dumps(entry))
    sleep = float(os.environ.get("CT_TASK_SLEEP", "0"))
    if sleep:
        time.sleep(sleep)


# -- decorator below @app.task ---------------------------------------------------------
@app.task
@throttle("5/s")
def below(label):
    record(label)


@app.task
@throttle("5/s")
def signalled(label):
    record(label)


# -- a busy key: a limit far above what a burst's first tasks use (leases) ---------------
@app.task
@throttle("300/s")
def busy(label):
    record(label)


@app.task
@throttle("300/s", "6000 tokens/s", cost={"tokens": 5})
def busy_tokens(label):
    """As busy, with tokens beside (a cost per rate: leases of calls)."""
    record(label)


# A key far under a limit of a long window: a lease may be used for 1 s (less than a
# quarter of it: timing.LEASE_MAX_US), so a process asks for one while it runs two calls a
# second, which a loaded machine's pool still does (beside the whole suite, a process of
# the tests took 40-140 ms a task: past the 125 ms within which busy's 250 ms leases pay
# at times).
@app.task
@throttle("1500/10s")
def busy_long(label):
    record(label)


@app.task
@throttle("1500/10s", "30000 tokens/10s", cost={"tokens": 5})
def busy_long_tokens(label):
    record(label)


# -- decorator above @app.task, fixed window, key template -----------------------------
@throttle("4/s", key="{tenant}", algorithm="fixed")
@app.task
def above(label, tenant):
    record(label, tenant=tenant)


# -- shared_task, two rates, shared scope, callable cost --------------------------------
@shared_task
@throttle("6/s", "9/3s", scope="shared-api", cost=lambda label, ids: len(ids))
def sync_issues(label, ids):
    record(label, ids=len(ids))


@app.task
@throttle("6/s", "9/3s", scope="shared-api")
def other_user_of_api(label):
    record(label)


# A scope of two rates whose second window (30 s) outlasts the CLI calls of a test that
# reads its counts after a live --replace (a 3 s one left its window under load).
@app.task
@throttle("6/s", "9/30s", scope="replaced-api")
def replaced_api(label):
    record(label)


# -- per-tenant plans via a callable rate ----------------------------------------------
PLANS = {"free": "2/s", "pro": "6/s"}


@app.task
@throttle(lambda label, tenant, plan: PLANS[plan], key="{tenant}")
def planned(label, tenant, plan):
    record(label, tenant=tenant)


# -- retry budget: the task's own retries still work, throttling spends none -----------
@app.task(bind=True, max_retries=0)
@throttle("3/s")
def no_retries(self, label):
    record(label)


@app.task(bind=True, max_retries=2, default_retry_delay=0.1)
@throttle("3/s", scope="retrying")
def retries_itself(self, label, fail_times):
    headers = self.request.headers if isinstance(self.request.headers, dict) else {}
    state = headers.get("celery_throttle") or getattr(self.request, "celery_throttle", None) or {}
    record(label, reservation=state.get("r"))
    if self.request.retries < fail_times:
        raise self.retry()


# -- tasks we do not own: throttled by throttle_rules ----------------------------------
@app.task
def unowned_export(label, tenant):
    record(label, tenant=tenant)


@app.task
def unowned_fixed(label):
    record(label)


@app.task
def unthrottled(label):
    record(label)


# -- long waits: parked in Redis -------------------------------------------------------
@app.task
@throttle("3/4s", key="{tenant}")
def slow_quota(label, tenant):
    record(label, tenant=tenant)


# -- a key argument that may be bad ----------------------------------------------------
@app.task
@throttle("10/s", key="{tenant}")
def keyed(label, tenant):
    record(label, tenant=repr(tenant))


# -- precision: generic task whose limit comes from its arguments ----------------------
@app.task
@throttle(lambda label, rate, algorithm: rate, key="{label}")
def precise_sliding(label, rate, algorithm="sliding"):
    record(label)


@app.task
@throttle(lambda label, rate: rate, key="{label}", algorithm="fixed")
def precise_fixed(label, rate):
    record(label)


# -- soak: many tenants, the rate and algorithm chosen by the caller -------------------
@app.task
@throttle(lambda label, tenant, rate: rate, key="{tenant}", scope="soak-sliding")
def soak_sliding(label, tenant, rate):
    record(label, tenant=tenant)


@app.task
@throttle(lambda label, tenant, rate: rate, key="{tenant}", scope="soak-fixed", algorithm="fixed")
def soak_fixed(label, tenant, rate):
    record(label, tenant=tenant)


# -- canvas: a chord's body, unthrottled ------------------------------------------------
@app.task
def collect(results, label):
    record(label, n=len(results))


# -- a cap on waiting -------------------------------------------------------------------
@app.task
@throttle("2/m", key="{tenant}", max_wait=5)
def capped(label, tenant):
    record(label, tenant=tenant)


# -- shadow mode: counted and reported, never held ---------------------------------------
@app.task
@throttle("2/s", scope="shadow-api", key="{tenant}", mode="shadow")
def shadowed(label, tenant):
    record(label, tenant=tenant)


@app.task
@throttle(concurrency=1, scope="shadow-slots", mode="shadow")
def shadowed_slot(label, seconds):
    record(label)
    time.sleep(seconds)


# -- priority within a line --------------------------------------------------------------
@app.task
@throttle("2/s", scope="priority-api", key="{tenant}")
def prioritized(label, tenant):
    record(label, tenant=tenant)


@app.task
@throttle("2/s", scope="priority-own", key="{tenant}", priority=lambda kind, **_: 5 if kind == "reset" else 0)
def by_kind(label, tenant, kind):
    record(label, tenant=tenant, kind=kind)


# -- operating: pauses and back-off ------------------------------------------------------
@app.task
@throttle("20/s", scope="pausable-api", key="{tenant}")
def pausable_keyed(label, tenant):
    record(label)


@app.task
@throttle("20/s", scope="pausable-api")
def pausable(label):
    record(label)


@app.task
@throttle("20/s", scope="vendor-api")
def vendor_call(label, backs_off=False):
    """Backs off (as on a 429 with Retry-After: 2) the first time it runs, if asked."""
    if backs_off and _records_client().set(f"{PREFIX}:backed-off:{label}", time.time(), nx=True):
        raise celery_throttle.Backoff(retry_after="2")
    record(label)


@app.task
@throttle("10/s", scope="live-api")
def live_fast(label):
    record(label)


@app.task
@throttle("2/s", scope="live-slow-api")
def live_slow(label):
    record(label)


# A key per test (its tenant): a live limit of one key lowered below its cost.
@app.task
@throttle("4/10s", key="{tenant}", scope="live-costly-api", cost=lambda label, tenant, units: units)
def live_costly(label, tenant, units):
    record(label, tenant=tenant)


@app.task
@throttle("4/10s", key="{tenant}", scope="live-costly-api", cost=lambda label, tenant, units: units)
def live_costly_backoff(label, tenant, units):
    """Its key's limit is lowered below its cost while it runs (read by this process, a
    refresh later), then it backs off: it can never fit again."""
    record(label, tenant=tenant)
    celery_throttle.install(app).set_limit("live-costly-api", ["2/10s"], key=tenant)
    time.sleep(CONTROL_REFRESH + 0.3)
    raise celery_throttle.Backoff(retry_after=1)


@app.task
@throttle("5/s", margin=0.2)
def margined(label):
    record(label)


# -- sent by tests/producer.py, a producer that imports this module and never finalizes -
@app.task
@throttle("3/10s", key="{tenant}")
def pub_below(label, tenant):
    record(label)


@throttle("3/10s", key="{tenant}")
@app.task
def pub_above(label, tenant):
    record(label)


@shared_task
@throttle("3/10s", key="{tenant}")
def pub_shared(label, tenant):
    record(label)


@app.task(bind=True)
@throttle("3/10s", key="{tenant}")
def pub_bound(self, label, tenant):
    record(label)


@app.task
def unowned_pub(label, tenant):  # throttled by a rule
    record(label)


# -- concurrency slots -----------------------------------------------------------------
def span(label: str, seconds: float, **extra) -> None:
    """A body that runs ``seconds``: its start (as it begins, and with its end, worker
    clock) is noted, for the test to count how many ran at once."""
    from celery import current_task

    started(label, **extra)
    start = time.time()
    time.sleep(seconds)
    delivery = current_task.request.delivery_info or {}
    entry = {"label": label, "id": current_task.request.id, "t0": start, "t1": time.time(), "pid": os.getpid(),
             "ppid": os.getppid(), "redelivered": bool(delivery.get("redelivered")),
             "via": delivery.get("routing_key"), "hostname": current_task.request.hostname, **extra}
    _records_client().rpush(f"{PREFIX}:spans", json.dumps(entry))


def started(label: str, **extra) -> None:
    """Note that a body started (before it runs long: a test may kill it)."""
    from celery import current_task

    entry = {"label": label, "id": current_task.request.id, "t": time.time(), "pid": os.getpid(),
             "ppid": os.getppid(), "via": (current_task.request.delivery_info or {}).get("routing_key"),
             "hostname": current_task.request.hostname, **extra}
    _records_client().rpush(f"{PREFIX}:began", json.dumps(entry))


@app.task
@throttle(concurrency=2, scope="export-api", key="{tenant}")
def exporting(label, tenant, seconds=0.3):
    span(label, seconds, tenant=tenant)


@app.task
@throttle(concurrency=1, scope="single-slot", key="{tenant}")
def single_slot(label, tenant, seconds=0.3):
    """One body at a time per tenant (a repeated task id too)."""
    span(label, seconds, tenant=tenant)


@app.task
@throttle("6/s", concurrency=2, key="{tenant}")
def campaign(label, tenant, seconds, units):
    """The fault campaign's task (tests/faults/test_campaign.py): per tenant 6 starts a
    second and 2 bodies at once; a body of ``seconds`` that reports ``units`` (0: a
    refund; 1: its estimate)."""
    record(label, tenant=tenant, units=units)
    time.sleep(seconds)
    celery_throttle.charge(units)


@app.task
@throttle("8/s", concurrency=2, key="{tenant}")
def rated_slots(label, tenant, seconds=0.4):
    span(label, seconds, tenant=tenant)


@app.task
@throttle("20/10s", "4000 tokens/10s", concurrency=4, key="{tenant}", cost={"tokens": 300})
def slotted_tokens(label, tenant, tokens, seconds=1.0):
    """An LLM-style call: 4 at once per tenant beside requests and tokens, each estimated
    at 300 tokens and settled with the ``tokens`` the call really used."""
    span(label, seconds, tenant=tenant)
    celery_throttle.charge(tokens=tokens)


@app.task(bind=True, max_retries=1, default_retry_delay=0.1, soft_time_limit=0.5)
@throttle(concurrency=1, scope="endings")
def ending(self, label, how):
    """Ends as it is told; its one slot must be free again after each ending."""
    from celery.exceptions import Ignore

    started(label, how=how, retries=self.request.retries)
    if how == "fail":
        raise ValueError("as told")
    if how == "ignore":
        raise Ignore()
    if how == "retry" and self.request.retries == 0:
        raise self.retry()
    if how == "soft":
        time.sleep(2)  # SoftTimeLimitExceeded is raised in here


@app.task
@throttle(concurrency=1, scope="capped-slot", key="{tenant}", max_wait=2)
def capped_slot(label, tenant, seconds=0.0):
    """One at a time per tenant, waiting 2 s for a slot at most."""
    started(label, tenant=tenant)
    time.sleep(seconds)


@app.task
@throttle("100/s", scope="live-slotted", key="{tenant}")
def rated_only(label, tenant, seconds=2.0):
    """A rates-only throttle, for a live concurrency limit to give slots to."""
    span(label, seconds, tenant=tenant)


@app.task
@throttle(concurrency=1, scope="long-holder", key="{tenant}")
def long_holder(label, tenant, seconds=60):
    started(label, tenant=tenant)
    time.sleep(seconds)


#: The weights of the tenants of the shared scope below (the others weigh 1).
SHARE_WEIGHTS = {"heavy": 2}


@app.task
@throttle(concurrency=4, scope="shared-slots", key="{tenant}",
          share=celery_throttle.Share(weight=lambda label, tenant, seconds=0.3: SHARE_WEIGHTS.get(tenant, 1)))
def shared_slots(label, tenant, seconds=0.3):
    """4 bodies of the scope at once, across its tenants, shared by weight."""
    span(label, seconds, tenant=tenant)


# -- costs settled after the call -------------------------------------------------------
@app.task
@throttle("6/2s", key="{tenant}", cost=3)
def estimated_high(label, tenant, used):
    """Estimated at 3 units, reports ``used`` (a refund below 3)."""
    record(label)
    celery_throttle.charge(used)


@app.task
@throttle("4/2s", key="{tenant}", cost_after=lambda used: used)
def estimated_low(label, tenant, used):
    """Estimated at 1 unit, returns what it used: ``cost_after`` charges it."""
    record(label)
    return used


@app.task
@throttle("20/10s", "8 tokens/10s", key="{tenant}", cost={"tokens": 4})
def tokens_estimated(label, tenant, used):
    """20 requests and 8 tokens per 10 s (an LLM API's two limits), a call estimated at 4
    tokens; reports the ``used`` tokens by unit."""
    record(label)
    celery_throttle.charge(tokens=used)


@app.task
@throttle("20/m", "1000 tokens/m", key="{tenant}", cost={"tokens": 400})
def refused_once(label, tenant, used, refund):
    """An LLM call the API answers 429 the first time it runs: the body reports the tokens
    that attempt used (none) if ``refund``, and backs off; run again, it reports ``used``."""
    if _records_client().set(f"{PREFIX}:refused:{label}", time.time(), nx=True):
        if refund:
            celery_throttle.charge(tokens=0)
        raise celery_throttle.Backoff(retry_after="1")
    record(label)
    celery_throttle.charge(tokens=used)


@app.task
@throttle("10/m", "1000 tokens/m", key="{tenant}", cost={"tokens": 100})
def observing(label, tenant, headers, elapsed=None):
    """A call whose reply carries the API's own count (``headers``): its key is brought to it.
    ``elapsed``: seconds the reply took, as ``requests`` says it (``response.elapsed``)."""
    reply = headers if elapsed is None else SimpleNamespace(headers=headers, elapsed=timedelta(seconds=elapsed))
    added = celery_throttle.observe(reply)
    record(label, tenant=tenant, added=added)


@app.task
@throttle("20/2s", "8 tokens/2s", key="{tenant}", cost={"tokens": 4})
def tokens_quick(label, tenant):
    """20 requests and 8 tokens per 2 s, 4 tokens a call: 2 a window, by the tokens."""
    record(label)


@app.task
@throttle("20/10s", "8 tokens/10s", key="{tenant}", cost={"tokens": 1},
          cost_after=lambda used: {"tokens": used})
def tokens_after(label, tenant, used):
    """As tokens_estimated, estimated at 1 token: ``cost_after`` reports ``used`` by unit."""
    record(label)
    return used


# -- capacity that appears after the deferral (issue: a start decided when there is room) --
@app.task
@throttle("6/m", scope="raisable", key="{tenant}")
def raisable(label, tenant):
    """6 a minute, until an operator raises (or resets) the tenant's key."""
    record(label)


@app.task
@throttle("10/4s", key="{tenant}", cost=5)
def refunded(label, tenant):
    """Estimated at 5 units, reports 1: the 4 come back as it starts."""
    record(label)
    celery_throttle.charge(1)


@app.task
@throttle("10/2s", key="{tenant}")
def slow_body(label, tenant, seconds=1.0):
    """A body slower than the limit's pace on few processes: the pool is the bottleneck."""
    record(label)
    time.sleep(seconds)


@app.task
@throttle("10/2s", key="{tenant}")
def overrunning(label, tenant, used=5):
    """Estimated at 1 unit, reports ``used`` as it starts (an overrun)."""
    record(label)
    celery_throttle.charge(used)


# -- limits that learn the downstream ----------------------------------------------------
#: A downstream API that takes at most ``limit`` calls in any second (a sliding log in the
#: records' Redis, the limit set by the test at ``<prefix>:downstream-limit``): its
#: refusals are the 429s an adaptive throttle learns from.
_DOWNSTREAM = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 1000000)
if redis.call('ZCARD', KEYS[1]) >= tonumber(redis.call('GET', KEYS[2]) or '5') then return 0 end
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('PEXPIRE', KEYS[1], 5000)
return 1
"""


def downstream_takes(call_id: str) -> bool:
    client = _records_client()
    return bool(client.eval(_DOWNSTREAM, 2, f"{PREFIX}:downstream", f"{PREFIX}:downstream-limit",
                            int(time.time() * 1_000_000), call_id))


@app.task(bind=True)
@throttle("20/s", scope="adaptive-api", adapt=True)
def adaptive_call(self, label, n, retry_after=1):
    """A call of a downstream whose limit the throttle does not know: a 429 raises Backoff
    (with ``retry_after`` as the API's Retry-After: None, it says nothing)."""
    if not downstream_takes(f"{self.request.id}:{time.time()}"):
        _records_client().rpush(f"{PREFIX}:refused", json.dumps({"label": label, "n": n, "t": time.time()}))
        raise celery_throttle.Backoff(retry_after=retry_after)
    record(label, n=n)
