"""The store's password, through the real commands: ``celery report`` (what Celery's issue
template asks users to paste), ``celery inspect conf`` answered by a real worker (and that
worker's log), ``celery throttle doctor``, whether the store answers, refuses the password
or cannot be reached (issue 44, item 6)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

from tests.helpers import BROKER_URL, REDIS, ROOT, RedisServer, WorkerGroup, free_port

#: Every secret the tests give; none may be shown.
SECRETS = ("s3cret-pass", "s3cret-opt", "s3cret-sentinel", "s3cret-sk")
URL = f"{REDIS}/12".replace("redis://", "redis://:s3cret-pass@", 1)
OPTIONS = {"password": "s3cret-opt"}


def _sentinels() -> str:
    """Two Sentinels where nothing listens, with the master's password in the URL."""
    return ";".join(f"sentinel://:s3cret-sentinel@127.0.0.1:{free_port()}" for _ in range(2))


SENTINEL_OPTIONS = {"master_name": "mymaster", "sentinel_kwargs": {"password": "s3cret-sk"}, "socket_timeout": 1}


def _celery(prefix: str, url: str, options: dict, *args: str, order: str = "before"
            ) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.secretapp ARGS``, the app module installing the throttle at import."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CT_PREFIX=prefix, CT_BROKER=BROKER_URL, CT_SECRET_URL=url,
               CT_SECRET_OPTIONS=json.dumps(options), CT_SECRET_ORDER=order)
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.secretapp", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)


def _assert_no_secret(out: subprocess.CompletedProcess[str] | str) -> None:
    text = out if isinstance(out, str) else out.stdout + out.stderr
    shown = [secret for secret in SECRETS if secret in text]
    assert not shown, f"{shown} shown in:\n{text}"


@pytest.mark.parametrize("order", ["before", "after", "namespace"])
def test_celery_report_shows_no_store_password(prefix: str, order: str) -> None:
    # Given an app module that sets a store URL and options with passwords and calls
    # install(app) at import: before its configuration loads, after, or under a namespace
    # When `celery report` runs (no worker, nothing read the throttle's settings)
    out = _celery(prefix, URL, OPTIONS, "report", order=order)
    # Then it shows the settings, masked
    assert out.returncode == 0, out.stderr
    _assert_no_secret(out)
    name = "CELERY_THROTTLE_REDIS_URL" if order == "namespace" else "throttle_redis_url"
    assert f"{name}: 'redis://:**@127.0.0.1:" in out.stdout, out.stdout


def test_celery_report_shows_no_sentinel_password(prefix: str) -> None:
    out = _celery(prefix, _sentinels(), SENTINEL_OPTIONS, "report")
    assert out.returncode == 0, out.stderr
    _assert_no_secret(out)
    assert "throttle_redis_url: 'sentinel://:**@127.0.0.1:" in out.stdout, out.stdout


def test_throttle_doctor_shows_no_store_password_when_the_store_answers(prefix: str) -> None:
    # (the local Redis has no password: it takes any, and the doctor reads it)
    out = _celery(prefix, URL, OPTIONS, "throttle", "doctor")
    _assert_no_secret(out)
    assert out.stdout.startswith("store redis://:**@127.0.0.1:"), out.stdout + out.stderr


@pytest.fixture
def guarded() -> Iterator[RedisServer]:
    """A Redis of its own that asks for a password no test gives."""
    server = RedisServer().start()
    try:
        admin = redis.Redis(port=server.port)
        admin.config_set("requirepass", "the-right-one")
        admin.close()
        yield server
    finally:
        server.stop()


def test_throttle_doctor_shows_no_store_password_when_the_store_refuses_it(prefix: str,
                                                                          guarded: RedisServer) -> None:
    url = f"redis://:s3cret-pass@127.0.0.1:{guarded.port}/0"
    out = _celery(prefix, url, OPTIONS, "throttle", "doctor")
    # Then it fails, in one line that says where and why, and shows neither password
    assert out.returncode == 1
    _assert_no_secret(out)
    assert out.stderr.startswith(f"Error: Redis at redis://:**@127.0.0.1:{guarded.port}/0 failed: "), out.stderr
    assert "Traceback" not in out.stderr


def test_throttle_doctor_shows_no_sentinel_password_when_no_sentinel_answers(prefix: str) -> None:
    out = _celery(prefix, _sentinels(), SENTINEL_OPTIONS, "throttle", "doctor")
    assert out.returncode == 1
    _assert_no_secret(out)
    assert out.stderr.startswith("Error: Redis at sentinel://:**@127.0.0.1:"), out.stderr
    assert "No master found for 'mymaster'" in out.stderr


def test_inspect_conf_and_the_worker_log_show_no_store_password(prefix: str, guarded: RedisServer) -> None:
    # Given a worker (tests.taskapp installs the throttle at import) whose store refuses
    # the password it was given: it starts, and logs that the store failed
    url = f"redis://:s3cret-pass@127.0.0.1:{guarded.port}/0"
    group = WorkerGroup(prefix=prefix, broker=BROKER_URL, store=url, count=1, concurrency=1,
                        env={"CT_STORE_OPTIONS": json.dumps(OPTIONS)})
    try:
        group.start()
        # When a broker client asks it for its configuration
        node = f"w0-{prefix}@{socket.gethostname()}"
        out = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.taskapp", "inspect", "conf",
                              "-d", node, "-t", "10"], cwd=ROOT, env=group._environ(), capture_output=True,
                             text=True, timeout=60, check=False)
        # Then its answer shows the URL masked, and the options' password masked by Celery
        assert out.returncode == 0 and node in out.stdout, out.stdout + out.stderr
        _assert_no_secret(out)
        assert f"redis://:**@127.0.0.1:{guarded.port}/0" in out.stdout, out.stdout
        # and nothing the worker logged (its start, the store's failure) shows one
        log = group.log_text()
        assert f"127.0.0.1:{guarded.port}" in log, log[-3000:]
        _assert_no_secret(log)
    finally:
        group.stop()
