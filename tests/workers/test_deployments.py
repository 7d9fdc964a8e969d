"""Redis deployments users run: Sentinel (with a failover), TLS, ACL users.

Sentinel: workers follow a failover, nothing is lost or run twice.

A throwaway primary, a replica and one Sentinel on loopback ports (the broker stays the
suite's Redis). The primary is killed in the middle of a burst; the Sentinel promotes
the replica, redis-py's Sentinel client finds it, and the tasks that met the outage are
deferred under ``throttle_on_store_error`` ("defer") until it is over.

Replication is asynchronous: what the primary counted in its last moments may not have
reached the replica, so the window can admit more than its limit once, right after the
failover. The test measures it and bounds it by two windows' worth.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import celery_throttle
from celery_throttle import ConfigurationError, StoreError
from celery_throttle.core.keys import state_key
from tests.helpers import (
    BROKER_URL,
    RedisServer,
    SlowProxy,
    WorkerGroup,
    delete_queues,
    free_port,
    max_in_window,
    max_started_in,
    new_label,
    wait_for,
)

MASTER = "ct-master"


class Sentinels:
    """A primary, a replica of it, and one Sentinel watching them (quorum 1). ``via_link``:
    the primary is reached through a link (:attr:`link`, a proxy: the Sentinel monitors it
    there, the replica replicates from there) whose replication a test may cut, so that
    the primary acknowledges writes the replica never gets."""

    def __init__(self, via_link: bool = False) -> None:
        self.primary = RedisServer().start()
        self.link = SlowProxy(self.primary.url, 0).start() if via_link else None
        upstream = self.link.port if self.link else self.primary.port
        self.replica = RedisServer(extra=["--replicaof", "127.0.0.1", str(upstream)]).start()
        self.port = free_port()
        conf = Path(self.primary.dir) / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.primary.dir}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {upstream} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 5000\n"
        )
        self.proc = subprocess.Popen(["redis-server", str(conf), "--sentinel"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.sentinel = redis.Redis(port=self.port, socket_connect_timeout=0.5, decode_responses=True)
        replica = redis.Redis(port=self.replica.port, decode_responses=True)
        wait_for(lambda: replica.info("replication").get("master_link_status") == "up", 15,
                 what="the replica in sync")
        wait_for(lambda: self._knows_replica(), 15, what="the Sentinel to see the replica")

    def _knows_replica(self) -> bool:
        try:
            return bool(self.sentinel.execute_command("SENTINEL", "REPLICAS", MASTER))
        except redis.RedisError:
            return False

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.port}"

    def master_port(self) -> int:
        return int(self.sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)[1])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        if self.link:
            self.link.stop()
        self.replica.stop()
        self.primary.stop()


@pytest.fixture
def sentinels() -> Iterator[Sentinels]:
    group = Sentinels()
    yield group
    group.stop()


def test_a_sentinel_url_reaches_the_master_and_needs_its_group_named(sentinels: Sentinels) -> None:
    from celery import Celery

    app = Celery("sentinel-direct", broker=BROKER_URL, set_as_current=False)
    ctl = celery_throttle.install(app, redis_url=f"{sentinels.url};sentinel://127.0.0.1:{free_port()}",
                                  redis_options={"master_name": MASTER})
    decisions = [ctl.acquire("api", rates=["2/s"]).allowed for _ in range(3)]
    assert decisions == [True, True, False]
    assert list(redis.Redis(port=sentinels.primary.port).scan_iter(match="throttle*")), "state on the master"
    nameless = celery_throttle.install(Celery("nameless", broker=BROKER_URL, set_as_current=False),
                                       redis_url=sentinels.url)
    with pytest.raises(ConfigurationError, match="master_name"):
        nameless.acquire("api", rates=["2/s"])


#: Starts are read in the task bodies, which a loaded 2-core machine (here also running
#: three Redis servers and the Sentinels) may reach more than the check's slack after the
#: check: windows are measured 20 ms short of the limit's (as in test_operate and
#: test_pools; a CI run saw 6 starts before the kill within 1.0 s).
WINDOW = 0.98


def test_workers_follow_a_failover_and_every_task_runs_once(sentinels: Sentinels) -> None:
    prefix = f"ct-sentinel-{uuid.uuid4().hex[:8]}"
    group = WorkerGroup(prefix=prefix, broker=BROKER_URL, store=sentinels.url, count=2, concurrency=2,
                        env={"CT_STORE_OPTIONS": json.dumps({"master_name": MASTER})})
    group.start()
    try:
        label = uuid.uuid4().hex[:10]
        ids = [group.send("below", label) for _ in range(40)]  # 5/s: about 8 s of work
        wait_for(lambda: len(group.starts(label)) >= 10, 20, what="the burst under way")
        # When the primary dies mid-burst
        killed_at = time.time()
        sentinels.primary.kill()
        wait_for(lambda: sentinels.master_port() == sentinels.replica.port, 20, 0.2,
                 what="the Sentinel to promote the replica")
        starts = group.wait_starts(label, 40, timeout=90, settle=2.0)
    finally:
        group.stop()
        delete_queues(BROKER_URL, group.queues)
        group.records.delete(f"{prefix}:starts", f"{prefix}:throttled", f"{prefix}:prerun", f"{prefix}:postrun")
    # Then every task ran exactly once
    counts = Counter(e["id"] for e in starts)
    assert sorted(counts) == sorted(ids) and max(counts.values()) == 1
    # and the window held, but for what the lost replication may let through once
    times = sorted(e["t"] for e in starts)
    before = [t for t in times if t < killed_at]
    after = [t for t in times if t >= killed_at]
    worst_after = max_in_window(after, 1.0)
    print(f"\nfailover: {len(before)} started before the kill, {len(after)} after; "
          f"most in any 1 s: {max_in_window(before, WINDOW)} before, {worst_after} after (limit 5)")
    assert max_in_window(before, WINDOW) <= 5
    assert worst_after <= 10, "more than a second window's worth admitted after the failover"


#: The failover test's tasks: sent in two halves, the second while the replica hears
#: nothing (3 start every 4 s: each half still waits, most of it, at the failover).
HALF = 8


def test_a_failover_that_loses_the_last_writes_loses_no_waiting_task() -> None:
    # Given a store behind Sentinel whose replica replicates through a link we can cut,
    # a Redis broker apart from it (the journal on, by default), and one worker
    sentinels = Sentinels(via_link=True)
    assert sentinels.link is not None
    prefix = f"ct-test-{uuid.uuid4().hex[:10]}"
    group = WorkerGroup(prefix=prefix, broker=BROKER_URL, store=sentinels.url, count=1,
                        env={"CT_STORE_OPTIONS": json.dumps({"master_name": MASTER})})
    label, tenant = new_label(), f"failover-{new_label()}"
    line = f"{state_key(prefix, 'tests.taskapp.slow_quota', tenant)}:line"
    primary, replica = (redis.Redis(port=p) for p in (sentinels.primary.port, sentinels.replica.port))
    try:
        group.start()
        assert "with a copy in the broker's journal" in group.log_text()
        # When half the tasks wait in the key's line, on both servers
        ids = [group.send("slow_quota", label, tenant) for _ in range(HALF)]
        wait_for(lambda: primary.zcard(line) >= HALF - 3 and replica.zcard(line) == primary.zcard(line), 20, 0.05,
                 what="the first half waiting, replicated")
        # and the other half joins the line while the replica hears nothing: the primary
        # acknowledges what it will never pass on
        sentinels.link.cut_replication()
        ids += [group.send("slow_quota", label, tenant) for _ in range(HALF)]
        wait_for(lambda: primary.zcard(line) >= replica.zcard(line) + HALF - 2, 20, 0.05,
                 what="the second half waiting on the primary alone")
        unreplicated = primary.zcard(line) - replica.zcard(line)
        time.sleep(0.5)  # (their journal copies published: a moment after their calls)
        # and the primary dies: the Sentinel promotes the replica, which never heard of them
        killed_at = time.time()
        sentinels.primary.kill()
        wait_for(lambda: sentinels.master_port() == sentinels.replica.port, 30, 0.2,
                 what="the Sentinel to promote the replica")
        # Then every task runs: those the new primary does not know are sent on from the
        # journal (its epoch is new: the store's replication id changed), each once
        starts = group.wait_starts(label, len(ids), timeout=120, settle=3.0)
        counts = Counter(e["id"] for e in starts)
        print(f"\nfailover with {unreplicated} joins never replicated: {len(starts)} starts of {len(ids)} tasks")
        assert sorted(counts) == sorted(ids), f"never ran: {sorted(set(ids) - set(counts))}"
        assert max(counts.values()) == 1, f"ran twice: {[i for i, n in counts.items() if n > 1]}"
        assert re.search(r"sent on from the journal", group.log_text())
        # and the limit holds after the failover (what the old primary counted in its last
        # moments may be counted again: 2 windows' worth at most)
        assert max_started_in(sorted(e["t"] for e in starts if e["t"] > killed_at), 4.0) <= 6
    finally:
        group.stop()
        sentinels.stop()
        delete_queues(BROKER_URL, group.queues)
        group.records.delete(f"{prefix}:starts", f"{prefix}:throttled", f"{prefix}:prerun", f"{prefix}:postrun")
        primary.close()
        replica.close()


def _tls_server(tmp: Path) -> tuple[subprocess.Popen, int, Path]:
    """A redis-server speaking TLS only, with a self-signed certificate (skips without
    openssl or a redis-server built with TLS)."""
    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    for binary in _redis_servers():
        port = free_port()
        proc = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                                 "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                                 "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
                                 "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert),
                             socket_connect_timeout=0.3)
        time.sleep(0.3)  # a build without TLS exits at once on the tls-port directive
        if proc.poll() is not None:
            continue
        try:
            wait_for(lambda: _pings(client), 5, what="TLS redis-server")  # noqa: B023
        except AssertionError:
            pass
        if proc.poll() is None and _pings(client):
            return proc, port, cert
        proc.kill()
        proc.wait(5)
    pytest.skip("no redis-server here was built with TLS")


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _redis_servers() -> list[str]:
    """Every redis-server on PATH (the first one may be a build without TLS). Run by the
    name found: Debian's is a link that reads its own name to know what to be."""
    found: dict[str, str] = {}
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        binary = Path(folder) / "redis-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            found.setdefault(str(binary.resolve()), str(binary))
    return list(found.values())


def test_tls_with_a_certificate_option_and_a_clear_error_without(tmp_path: Path) -> None:
    from celery import Celery

    proc, port, cert = _tls_server(tmp_path)
    try:
        url = f"rediss://:secret-pw@127.0.0.1:{port}/0"
        app = Celery("tls", broker=BROKER_URL, set_as_current=False)
        # A password the server does not ask for is fine: it is only to show it is masked.
        ctl = celery_throttle.install(app, redis_url=url.replace(":secret-pw@", ""),
                                      redis_options={"ssl_ca_certs": str(cert)})
        assert [ctl.acquire("api", rates=["1/s"]).allowed for _ in range(2)] == [True, False]
        untrusted = celery_throttle.install(Celery("tls-untrusted", broker=BROKER_URL, set_as_current=False),
                                            redis_url=url)
        with pytest.raises(StoreError) as failure:
            untrusted.acquire("api", rates=["1/s"])
        assert "secret-pw" not in str(failure.value) and f"127.0.0.1:{port}" in str(failure.value)
    finally:
        proc.kill()
        proc.wait(5)


def test_an_acl_user_from_the_url_and_a_masked_error_for_a_wrong_password() -> None:
    from celery import Celery

    server = RedisServer().start()
    try:
        admin = redis.Redis(port=server.port)
        admin.execute_command("ACL", "SETUSER", "throttler", "on", ">right-pw", "~throttle*", "+@all")
        good = celery_throttle.install(Celery("acl", broker=BROKER_URL, set_as_current=False),
                                       redis_url=f"redis://throttler:right-pw@127.0.0.1:{server.port}/0")
        assert good.acquire("api", rates=["1/s"]).allowed
        bad = celery_throttle.install(Celery("acl-bad", broker=BROKER_URL, set_as_current=False),
                                      redis_url=f"redis://throttler:wrong-pw@127.0.0.1:{server.port}/0")
        with pytest.raises(StoreError) as failure:
            bad.acquire("api", rates=["1/s"])
        assert "wrong-pw" not in str(failure.value)
    finally:
        server.stop()
