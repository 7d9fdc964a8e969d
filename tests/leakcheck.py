"""``python -m tests.leakcheck COMMAND...``: run COMMAND, and fail if it left a key in any
database of the tests' Redis (``CT_REDIS``) that was not there before.

``make test`` runs its passes under it when ``CT_LEAKCHECK=1`` (CI sets it): the rule that
tests delete what they write (their keys, result keys, queues and kombu bindings), checked
once every pass has ended, so that one pass still running (the soak beside the suite) is
not taken for a leak. Which test left a key: ``pytest -p tests.leakcheck_plugin``. Keys
with a TTL count too (a result key's day is a day of clutter in a developer's Redis), and
are listed apart.
"""

from __future__ import annotations

import os
import subprocess
import sys

import redis

#: How many keys of each database the report names (the count is always whole).
SHOWN = 5


def databases(url: str) -> list[int]:
    """The numbers of the databases that hold a key now (INFO keyspace)."""
    client = redis.Redis.from_url(url)
    try:
        return sorted(int(name[2:]) for name in client.info("keyspace") if name.startswith("db"))
    finally:
        client.close()


def keys(url: str, dbs: list[int] | None = None) -> dict[int, set[bytes]]:
    """The keys of each database of the server at ``url`` (by SCAN): of ``dbs``, else of
    every database that holds one."""
    out: dict[int, set[bytes]] = {}
    for db in databases(url) if dbs is None else dbs:
        client = redis.Redis.from_url(url, db=db)
        try:
            out[db] = set(client.scan_iter(count=1000))
        finally:
            client.close()
    return out


def left_behind(url: str, before: dict[int, set[bytes]]) -> dict[int, tuple[list[bytes], list[bytes]]]:
    """The keys made since ``before`` and still there, by database: (without a TTL, with one)."""
    out = {}
    for db, now in keys(url).items():
        made = sorted(now - before.get(db, set()))
        if made:
            client = redis.Redis.from_url(url, db=db)
            try:
                expiring = {k for k in made if client.ttl(k) > 0}
            finally:
                client.close()
            out[db] = ([k for k in made if k not in expiring], [k for k in made if k in expiring])
    return out


def report(left: dict[int, tuple[list[bytes], list[bytes]]]) -> list[str]:
    lines = []
    for db, (lasting, expiring) in sorted(left.items()):
        for what, found in (("", lasting), (" (with a TTL)", expiring)):
            if found:
                names = ", ".join(k.decode(errors="replace") for k in found[:SHOWN])
                lines.append(f"db {db}: {len(found)} key(s) left{what}: {names}{' ...' if len(found) > SHOWN else ''}")
    return lines


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    url = os.environ.get("CT_REDIS", "redis://127.0.0.1:6379")
    before = keys(url)
    code = subprocess.call(argv)
    lines = report(left_behind(url, before))
    if not lines:
        print(f"tests.leakcheck: the run left no key in {url}", flush=True)
        return code
    print(f"tests.leakcheck: the run left keys in {url} (`pytest -p tests.leakcheck_plugin` says which test "
          "made them):", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    return code or 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
