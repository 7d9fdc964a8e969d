"""The tests' worker harness as the bench (``bench/``) uses it, beyond tests/helpers.py:
workers of another Celery app module, a redis-server of its own for a block, queues opened
to running workers, the errors in their logs, and waiting without failing.

The bench's app (``bench/app.py``) reads the same CT_* settings as tests/taskapp.py, so
:class:`AppWorkers` is tests/helpers.py's :class:`~tests.helpers.WorkerGroup`; its tasks
note each start in a list per label (``<prefix>:starts:<label>``), so that a flood of
100 000 starts is counted without being read.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from tests.helpers import RedisServer, WorkerGroup, wait_for


def waited(predicate: Callable[[], Any], timeout: float, interval: float = 0.1) -> bool:
    """Whether ``predicate`` came true within ``timeout`` s (``wait_for`` without the error)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


@contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    """A started :class:`~tests.helpers.RedisServer` (its databases all ours), stopped after."""
    server = RedisServer(extra=extra).start()
    try:
        yield server
    finally:
        server.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@contextmanager
def redis_cluster(masters: int = 3) -> Iterator[list[int]]:
    """A Redis Cluster of ``masters`` masters and no replicas on loopback, each a redis-server of its
    own, stopped after. Yields their ports (``redis+cluster://127.0.0.1:<first>`` names it)."""
    servers: list[RedisServer] = []
    try:
        for _ in range(masters):
            server = RedisServer(port=_cluster_port())
            server.extra = ["--cluster-enabled", "yes", "--cluster-config-file",
                            f"{server.dir}/nodes.conf", "--cluster-node-timeout", "2000"]
            servers.append(server.start())
        ports = [s.port for s in servers]
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        # Every node must see the cluster ok, not only the first: a node still joining
        # answers CLUSTERDOWN for its slots.
        clients = [redis.Redis(port=p) for p in ports]
        wait_for(lambda: all(c.cluster("info")["cluster_state"] == "ok" for c in clients), 20,
                 what="cluster ok on every node")
        for c in clients:
            c.close()
        yield ports
    finally:
        for server in servers:
            server.stop()


class AppWorkers(WorkerGroup):
    """:class:`~tests.helpers.WorkerGroup` running the Celery app module ``app``; notes
    (starts, denials) in ``records`` (default: the store). ``logs_to``: a folder the
    workers' logs are copied to when they stop (tests/helpers.py deletes its own)."""

    def __init__(self, app: str, prefix: str, broker: str, store: str, *, records: str | None = None,
                 logs_to: Path | None = None, **options: Any) -> None:
        super().__init__(prefix, broker, store, records=records or store, **options)
        self.app = app
        self.logs_to = logs_to
        self.opened: list[str] = []

    @property
    def queues(self) -> list[str]:
        return [*super().queues, *self.opened]

    def starts(self, label: str) -> list[dict]:
        return [json.loads(x) for x in self.records.lrange(f"{self.prefix}:starts:{label}", 0, -1)]

    def started(self, label: str) -> int:
        return int(self.records.llen(f"{self.prefix}:starts:{label}"))

    def note(self, name: str) -> int:
        """A counter the tasks keep, e.g. ``denied:<label>``."""
        return int(self.records.get(f"{self.prefix}:{name}") or 0)

    def consume(self, queue: str) -> int:
        """Every worker consumes ``queue`` too from now on; how many said so."""
        self.opened.append(queue)
        replies = self.client.control.add_consumer(queue, routing_key=queue, reply=True, timeout=5,
                                                   limit=self.count)
        return len(replies or [])

    def errors(self) -> list[str]:
        """Error lines of the workers' logs (errors, tracebacks)."""
        return [line.strip()[:300] for line in self.log_text().splitlines()
                if " ERROR/" in line or " CRITICAL/" in line or "Traceback" in line]

    def stop(self) -> None:
        if self.logs_to is not None:
            self.logs_to.mkdir(parents=True, exist_ok=True)
            for log in self.logs:
                if log.exists():
                    shutil.copyfile(log, self.logs_to / f"{self.prefix}-{log.name}")
        super().stop()
