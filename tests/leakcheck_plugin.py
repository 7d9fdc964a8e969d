"""``pytest -p tests.leakcheck_plugin``: which tests leave keys behind, and a failed run if any does.

Notes the keys of the tests' databases (the store's, db 12; the broker's and results',
db 13; and db 0) before and after every test; at the end of the run (every fixture torn
down) it lists the keys still there that were not there at its start, each with the test
that made it (under pytest-xdist, the test of the process that saw it appear: one running
beside it may have made it), keys with a TTL apart, and fails the run. ``make test`` checks
the same of all its passes at once when ``CT_LEAKCHECK=1`` (:mod:`tests.leakcheck`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import REDIS
from tests.leakcheck import keys

#: The databases the tests write: db 0, the store's (12) and the broker's (13).
DATABASES = [0, 12, 13]
_made_by: dict[str, str] = {}
_at_start: set[str] = set()
_left: list[str] = []


def _keys() -> set[str]:
    return {f"db{db}:{key.decode(errors='replace')}" for db, found in keys(REDIS, DATABASES).items()
            for key in found}


def pytest_sessionstart(session: pytest.Session) -> None:
    _at_start.update(_keys())


@pytest.fixture(autouse=True)
def _note_keys(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _keys()
    yield
    for key in _keys() - before:
        _made_by.setdefault(key, request.node.nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """(pytest-xdist, on the controller: what a worker process saw made.)"""
    _made_by.update(getattr(node, "workeroutput", {}).get("leakcheck_made_by", {}))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a worker process: the controller checks, once every worker ended
        workeroutput["leakcheck_made_by"] = _made_by
        return
    _left.extend(sorted(_keys() - _at_start))
    if _left and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if hasattr(config, "workeroutput"):
        return
    import redis

    by_test: dict[str, list[str]] = defaultdict(list)
    for key in _left:
        db, _, raw = key.partition(":")
        client = redis.Redis.from_url(f"{REDIS}/{db[2:]}")
        expiring = client.ttl(raw) > 0
        client.close()
        by_test[("(expiring) " if expiring else "") + _made_by.get(key, "(made outside any test)")].append(key)
    terminalreporter.section("keys left behind")
    if not _left:
        terminalreporter.write_line("none")
    for test, found in sorted(by_test.items()):
        terminalreporter.write_line(f"{len(found):4d} {test}: {', '.join(found[:3])}{' ...' if len(found) > 3 else ''}")
    if _left:
        terminalreporter.write_line("the run fails: tests delete what they write (CONTRIBUTING.md)", red=True)
