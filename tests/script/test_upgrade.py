"""The upgrade corpus: what a release left in the store and the broker, read by this one
(tests/fixtures/format-*.json, written by tests/fixtures/make_corpus.py with that
release's code). Format 3 is the first release's: the upgrade path starts there.

Tasks waiting in lines and tickets outlive a deploy by hours or days: a header, a state
hash or a line this version cannot read would lose them, or run them unthrottled.
Each corpus is restored under a prefix of this test (its own prefix rewritten, as a
deploy keeps one prefix), at the time it was written (a test clock), and replayed.
"""

from __future__ import annotations

import base64
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_throttle.celery_parts.messages import decode_message
from celery_throttle.check.limiter import Throttle
from celery_throttle.core.header import HEADER, Header
from celery_throttle.core.protocol import Code, Entry
from celery_throttle.core.spec import declared_spec
from tests.fixtures.make_corpus import STREAMS, build_app
from tests.helpers import STORE_URL

CORPORA = sorted((Path(__file__).parent.parent / "fixtures").glob("format-*.json"))
#: Restored keys are kept at least this long (ms) whatever their recorded TTL: the test
#: clock stands still, Redis' expiry does not.
KEPT_MS = 600_000


class FrozenClock:
    def __init__(self, now_us: int) -> None:
        self.now = now_us

    def __call__(self) -> int:
        return self.now


def _b(text: str) -> bytes:
    return base64.b64decode(text)


def restore(client: redis.Redis, prefix: str, keys: dict[str, Any]) -> None:
    for name, entry in keys.items():
        full = f"{prefix}:{name}"
        if entry["type"] == "hash":
            client.hset(full, mapping={_b(k): _b(v) for k, v in entry["value"].items()})
        elif entry["type"] == "zset":
            client.zadd(full, {_b(m): score for m, score in entry["value"]})
        elif entry["type"] == "string":
            client.set(full, _b(entry["value"]))
        if entry["pttl"] > 0:
            client.pexpire(full, max(entry["pttl"], KEPT_MS))


@pytest.fixture(params=CORPORA, ids=[p.stem for p in CORPORA])
def corpus(request: pytest.FixtureRequest) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(request.param.read_text())
    return data


@pytest.fixture
def replay(corpus: dict[str, Any], prefix: str, store_client: redis.Redis) -> Iterator[tuple[Any, Throttle, FrozenClock]]:
    restore(store_client, prefix, corpus["keys"])
    app, _ = build_app(prefix)
    clock = FrozenClock(corpus["now_us"])
    ctl = Throttle(app, {"redis_url": STORE_URL, "key_prefix": prefix}, clock=clock)
    yield app, ctl, clock
    ctl.close()


def _ours(corpus: dict[str, Any], prefix: str, header: dict[str, Any]) -> dict[str, Any]:
    """The header as if written under ``prefix`` (a deploy keeps its prefix)."""
    header = dict(header)
    if isinstance(header.get("k"), str):
        header["k"] = prefix + header["k"][corpus["prefix_length"]:]
    return header


def _format(corpus: dict[str, Any]) -> int:
    return int(corpus["header_version"])


def _lines(corpus: dict[str, Any]) -> dict[str, list[str]]:
    """The entry ids waiting in each stream's line, in order, by scope."""
    out: dict[str, list[str]] = {}
    for scope, key in STREAMS:
        name = f"{{{scope}:{key}}}:line" if key else f"{{{scope}}}:line"
        entries = corpus["keys"].get(name, {"value": []})["value"]
        out[scope] = [_b(m).decode() for m, _ in sorted(entries, key=lambda e: e[1])]
    return out


@pytest.mark.pure
def test_the_corpus_covers_what_it_must() -> None:
    # (a corpus that lost its tickets or waiting tasks would replay green, vacuously)
    assert CORPORA, "no upgrade corpus in tests/fixtures"
    for path in CORPORA:
        data = json.loads(path.read_text())
        assert sum(HEADER in m["headers"] for m in data["messages"]) >= 4, path
        assert data["keys"]["control"]["value"], path
        assert _format(data) >= 3, path  # (formats 1 and 2 were never released)
        assert sum(len(ids) for ids in _lines(data).values()) >= 4, path
        assert all(ids for ids in _lines(data).values()), path


def test_status_reads_the_old_state_as_it_was_read(corpus: dict[str, Any], replay: Any) -> None:
    # Given the keys an earlier release wrote, read at the time it wrote them
    _, ctl, _ = replay
    for scope, key in STREAMS:
        if f"{scope}:{key}" not in corpus["status"]:
            continue  # (a stream that corpus did not have)
        status = ctl.status(scope, key)
        want = corpus["status"][f"{scope}:{key}"]
        # Then every rate counts what it counted then
        assert [[str(r.rate), r.algorithm, r.used, r.remaining] for r in status.rates] == want["rates"]
        # and its line: who waits, who was released, who runs
        assert [status.waiting, status.released, status.running] == [want["waiting"], want["released"],
                                                                      want["running"]]
    # and its pause and its live limit still hold
    assert ctl.paused_until("corpus-paused") is not None
    assert [str(r) for r in ctl.live_limit("corpus-limited") or ()] == ["5/h"]


def _stream_calls(app: Any, ctl: Throttle) -> dict[str, Any]:
    """The bound call of each stream, by scope (the arguments make_corpus sends)."""
    sent = {"corpus.sliding": ("acme", 1), "corpus.fixed": (0,), "corpus.slotted": ("acme",)}
    calls = {}
    for name, args in sent.items():
        task = app.tasks[name]
        spec = declared_spec(task)
        assert spec is not None
        call = ctl.checker.bind_spec(name, spec, inspect.signature(task.run), args, {})
        calls[call.scope] = call
    return calls


def test_a_task_released_before_the_deploy_starts_once_after_it(corpus: dict[str, Any], replay: Any,
                                                                prefix: str) -> None:
    app, ctl, _ = replay
    calls = {call.state_key: call for call in _stream_calls(app, ctl).values()}
    for message in [m for m in corpus["messages"] if HEADER in m["headers"]]:
        # Given a task released from its line by the earlier release, with its ticket
        header = Header.read(_ours(corpus, prefix, message["headers"][HEADER]))
        assert header.key in calls and header.ticket, message["headers"][HEADER]
        call = calls[header.key]
        # When it arrives after the deploy, it starts on the room it was released into
        first = ctl.checker.claim(call, header.ticket, holder=f"{header.ticket}@w")
        assert first.code in (Code.RUN, Code.RUN_AT), (message["headers"]["task"], tuple(first))
        # and a copy of it (a redelivery) is not let in a second time
        entry = Entry(header.ticket, b"", message["headers"]["id"], 0, 0, 8)
        again = ctl.checker.claim(call, header.ticket, holder=f"{header.ticket}@w2", entry=entry)
        assert again.code == Code.DUPLICATE, tuple(again)


def test_tasks_waiting_in_a_line_before_the_deploy_are_released_after_it(corpus: dict[str, Any], replay: Any,
                                                                        prefix: str) -> None:
    app, ctl, clock = replay
    calls = _stream_calls(app, ctl)
    names = {"corpus.sliding": "corpus.sliding", "corpus-api": "corpus.fixed", "corpus-slots": "corpus.slotted"}
    waiting = _lines(corpus)
    for scope, ids in waiting.items():
        call = calls[scope]
        # Given the tasks waiting in a line the earlier release wrote, as their keys have
        # room (the windows pass, each start's slot ends)
        released: list[str] = []
        for _ in range(4 * len(ids) + 4):
            reply = ctl.checker.release(call, 64)
            for report in reply.reported:
                if report.kind == "f":
                    continue  # (released then, never arrived: its room is forgotten in time)
                assert report.kind == "r", report
                assert isinstance(report.payload, bytes)
                # (each one's message is the task it was)
                assert decode_message(app, report.payload)["task"] == names[scope]
                released.append(report.id)
                started = ctl.checker.claim(call, report.id, holder=f"{report.id}@w")
                assert started.code in (Code.RUN, Code.RUN_AT), tuple(started)
                ctl.checker.ended(call, f"{report.id}@w")
            if len(released) == len(ids):
                break
            clock.now = max(reply.due_us, clock.now + 1) if reply.due_us else clock.now + 60_000_000
        # Then every one is released, once each, in the order they waited
        assert released == ids, scope
