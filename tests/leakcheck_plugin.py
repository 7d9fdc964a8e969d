"""``pytest -p tests.leakcheck_plugin``: which tests leave keys behind.

Notes the keys of the broker's database (results, queues, kombu bindings) and of db 0
before and after every test; at the end of the run (every fixture torn down) it lists
the keys still there that were not there at its start, each with the test that made
it. Keys that expire on their own (a TTL) are listed apart. Not part of `make test`: a
tool for the rule that tests delete what they write.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.helpers import BROKER_URL, REDIS

_clients = {"broker": redis.Redis.from_url(BROKER_URL), "db0": redis.Redis.from_url(f"{REDIS}/0")}
_made_by: dict[str, str] = {}
_at_start: set[str] = set()


def _keys() -> set[str]:
    return {f"{name}:{key.decode(errors='replace')}" for name, client in _clients.items()
            for key in client.scan_iter(count=1000)}


def pytest_sessionstart(session: pytest.Session) -> None:
    _at_start.update(_keys())


@pytest.fixture(autouse=True)
def _note_keys(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _keys()
    yield
    for key in _keys() - before:
        _made_by.setdefault(key, request.node.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    left = sorted(_keys() - _at_start)
    by_test: dict[str, list[str]] = defaultdict(list)
    for key in left:
        name, _, raw = key.partition(":")
        expiring = _clients[name].ttl(raw) > 0
        by_test[("(expiring) " if expiring else "") + _made_by.get(key, "(made outside any test)")].append(key)
    terminalreporter.section("keys left behind")
    if not left:
        terminalreporter.write_line("none")
    for test, keys in sorted(by_test.items()):
        terminalreporter.write_line(f"{len(keys):4d} {test}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}")
