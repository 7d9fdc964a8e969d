"""Servers of a test's own that it may fail: a store of two Redis nodes watched by a
Sentinel, each behind a link that loses replies, and a RabbitMQ node.

``SentinelStore``: node A (primary) and node B (its replica), each reached only through a
``tests.slow_proxy`` link of its own (the Sentinel monitors A at its link's address, B
replicates from there and announces its own link's port), so clients, the Sentinel and
replication all cross the links: a failover, a restart, a dropped link reach everyone as
they would across a network.

``RabbitNode``: a RabbitMQ node of its own (its name, port, data directory), started by
the machine's ``rabbitmq-server`` (which runs it as the ``rabbitmq`` user: its directory
is that user's), stopped the way a restart stops one (SIGTERM: it syncs its queues).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from tests.helpers import RedisServer, SlowProxy, free_port, wait_for

#: The Sentinel group's name.
MASTER = "ct-campaign"
#: How long (ms) the Sentinel waits before it calls a silent primary down: a restart of
#: the primary shorter than this is a restart, not a failover.
DOWN_AFTER_MS = 1500
#: How long (s) a failover waits for the Sentinel to promote the replica by itself.
PROMOTE_BY_ITSELF_S = 15


class SentinelStore:
    """Two Redis nodes (a primary and its replica) and a Sentinel, each node behind a
    link that loses ``lose`` of its replies (``seed``)."""

    def __init__(self, lose: float, seed: int) -> None:
        self.nodes = [RedisServer(), RedisServer()]
        self.links = [SlowProxy(node.url, 0, lose=lose, seed=seed + i).start() for i, node in enumerate(self.nodes)]
        self._start(0)
        self._start(1, replica_of=0)
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="ct-sentinel-")
        conf = Path(self.dir) / "sentinel.conf"
        conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
                        f"sentinel monitor {MASTER} 127.0.0.1 {self.links[0].port} 1\n"
                        f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                        f"sentinel failover-timeout {MASTER} 5000\n")
        self.proc = subprocess.Popen([self.nodes[0].binary or "redis-server", str(conf), "--sentinel"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.sentinel = redis.Redis(port=self.port, socket_connect_timeout=0.5, decode_responses=True)
        replica = redis.Redis(port=self.nodes[1].port, decode_responses=True)
        wait_for(lambda: _asks(lambda: replica.info("replication").get("master_link_status") == "up"), 15,
                 what="the replica in sync")
        wait_for(lambda: _asks(lambda: self.sentinel.execute_command("SENTINEL", "REPLICAS", MASTER)), 15,
                 what="the Sentinel to see the replica")
        replica.close()

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.port}"

    @property
    def options(self) -> dict[str, str]:
        return {"master_name": MASTER}

    def primary(self) -> int:
        """The index of the node the Sentinel names primary now."""
        port = int(self.sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)[1])
        return [link.port for link in self.links].index(port)

    def client(self) -> redis.Redis:
        """A client of the primary now, straight to it (not across its link)."""
        return redis.Redis(port=self.nodes[self.primary()].port)

    def _start(self, i: int, replica_of: int | None = None) -> None:
        """Node ``i`` started (empty), a primary or (``replica_of``) a replica of that
        node, announcing its link's port. (Each start says the role: a node started
        again by its first command line would come back as the replica it once was, of a
        node that is now its own replica, and the group would have no primary.)"""
        node = self.nodes[i]
        node.extra = ["--replica-announce-ip", "127.0.0.1", "--replica-announce-port", str(self.links[i].port)]
        if replica_of is not None:
            node.extra += ["--replicaof", "127.0.0.1", str(self.links[replica_of].port)]
        node.start()

    def restart_primary_empty(self) -> None:
        """The primary killed and started again, empty, before the Sentinel calls it down
        (its replica follows it, and empties too)."""
        i = self.primary()
        self.nodes[i].kill()
        self._start(i)

    def fail_over(self) -> float:
        """The primary killed; once the Sentinel has promoted its replica, started again,
        empty (the Sentinel makes it the new primary's replica). Returns when the replica
        was seen promoted (time.time()): what the old primary wrote last is lost then."""
        was = self.primary()
        self.nodes[was].kill()
        try:
            wait_for(lambda: _asks(lambda: self.primary() != was), PROMOTE_BY_ITSELF_S, 0.05,
                     what="the Sentinel to promote the replica")
        except AssertionError:
            self._promote_by_hand(was)
        promoted = time.time()
        self._start(was, replica_of=1 - was)
        with redis.Redis(port=self.nodes[was].port, decode_responses=True) as old:
            wait_for(lambda: _asks(lambda: old.info("replication").get("master_link_status") == "up"), 60, 0.2,
                     what="the old primary back as the new one's replica")
        return promoted

    def _promote_by_hand(self, was: int) -> None:
        """On a loaded machine the Sentinel may not promote the replica by itself (beside a
        CPU hog, a few campaigns in 30 waited past 30 s, and a forced SENTINEL FAILOVER
        found no replica it would take). It is told to fail over, again for a while; then
        the replica is promoted as an operator would (REPLICAOF NO ONE: a new replication
        id, as a Sentinel's promotion gives) and the Sentinel told to watch it."""
        def told() -> bool:
            _asks(lambda: self.sentinel.execute_command("SENTINEL", "FAILOVER", MASTER))
            return _asks(lambda: self.primary() != was)

        try:
            wait_for(told, 10, 1.0, what="the Sentinel to promote the replica, told to fail over")
            return
        except AssertionError:
            pass
        other = 1 - was
        with redis.Redis(port=self.nodes[other].port) as replica:
            replica.execute_command("REPLICAOF", "NO", "ONE")
        _asks(lambda: self.sentinel.execute_command("SENTINEL", "REMOVE", MASTER))
        self.sentinel.execute_command("SENTINEL", "MONITOR", MASTER, "127.0.0.1", self.links[other].port, 1)
        self.sentinel.execute_command("SENTINEL", "SET", MASTER, "down-after-milliseconds", DOWN_AFTER_MS,
                                      "failover-timeout", 5000)
        wait_for(lambda: _asks(lambda: self.primary() == other), 10, 0.05, what="the Sentinel to watch the promoted node")

    def drop_links(self, seconds: float) -> None:
        for link in self.links:
            link.stop()
        time.sleep(seconds)
        for link in self.links:
            link.start()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        self.sentinel.close()
        for link in self.links:
            link.stop()
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _asks(ask: object) -> bool:
    try:
        return bool(ask())  # type: ignore[operator]
    except (redis.RedisError, OSError, ValueError):
        return False


class RabbitNode:
    """A RabbitMQ node of the test's own on a free port (skips where the machine has no
    ``rabbitmq-server`` or cannot give it a directory)."""

    def __init__(self) -> None:
        binary = shutil.which("rabbitmq-server")
        if binary is None or os.geteuid() != 0:
            pytest.skip("no rabbitmq-server here to start a node of the test's own (it needs root to run as rabbitmq)")
        self.binary = binary
        self.port, self.dist_port = free_port(), free_port()
        self.name = f"ct{self.port}@localhost"
        self.dir = Path(tempfile.mkdtemp(prefix="ct-rabbit-"))
        for sub in ("mnesia", "log"):
            (self.dir / sub).mkdir()
        (self.dir / "plugins").write_text("[].\n")
        (self.dir / "rabbitmq.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\nloopback_users = none\n")
        shutil.chown(self.dir, "rabbitmq")
        for path in self.dir.rglob("*"):
            shutil.chown(path, "rabbitmq")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self) -> RabbitNode:
        env = {**os.environ, "RABBITMQ_NODENAME": self.name, "RABBITMQ_DIST_PORT": str(self.dist_port),
               "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"), "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
               "RABBITMQ_LOG_BASE": str(self.dir / "log"), "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "plugins"),
               "RABBITMQ_PID_FILE": str(self.dir / "pid")}
        self.proc = subprocess.Popen([self.binary], env=env, cwd=self.dir, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_for(lambda: self._listens(), 90, 0.2, what=f"RabbitMQ node {self.name}")
        return self

    def _listens(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.5).close()
            return True
        except OSError:
            return False

    def stop(self, clean: bool = False) -> None:
        """Stop the node as a restart does (SIGTERM to the Erlang VM: it syncs its queues
        and exits); ``clean``: its directory goes too."""
        pid_file = self.dir / "pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (ValueError, ProcessLookupError):
                pass
        if self.proc is not None:
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        wait_for(lambda: not self._listens(), 30, 0.2, what=f"RabbitMQ node {self.name} to stop")
        if clean:
            shutil.rmtree(self.dir, ignore_errors=True)
