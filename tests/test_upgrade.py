"""The upgrade corpus: what an earlier release left in the store and the broker, read by
this one (tests/fixtures/format-*.json, written by tests/fixtures/make_corpus.py with
that release's code).

Reservations and parked tasks outlive a deploy by hours or days: a header, a state hash
or a parked message this version cannot read would lose them, or run them unthrottled.
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

from celery_throttle.keys import state_key
from celery_throttle.limiter import Throttle
from celery_throttle.messages import decode_message
from celery_throttle.parking import Releaser
from celery_throttle.protocol import HEADER, Code, Reservation, read_state
from celery_throttle.spec import declared_spec
from tests.fixtures.make_corpus import STREAMS, build_app, drained
from tests.helpers import STORE_URL

CORPORA = sorted((Path(__file__).parent / "fixtures").glob("format-*.json"))
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
    ctl = Throttle(app, {"redis_url": STORE_URL, "key_prefix": prefix, "park_after": 30.0}, clock=clock)
    yield app, ctl, clock
    ctl.close()


def _ours(corpus: dict[str, Any], prefix: str, header: dict[str, Any]) -> dict[str, Any]:
    """The header as if written under ``prefix`` (a deploy keeps its prefix)."""
    header = dict(header)
    if isinstance(header.get("k"), str):
        header["k"] = prefix + header["k"][corpus["prefix_length"]:]
    return header


def test_the_corpus_covers_what_it_must() -> None:
    # (a corpus that lost its reservations or parked tasks would replay green, vacuously)
    assert CORPORA, "no upgrade corpus in tests/fixtures"
    for path in CORPORA:
        data = json.loads(path.read_text())
        assert sum(HEADER in m["headers"] for m in data["messages"]) >= 4, path
        assert len(data["keys"]["{parked}:due"]["value"]) >= 4, path
        assert data["keys"]["control"]["value"], path


def test_status_reads_the_old_state_as_it_was_read(corpus: dict[str, Any], replay: Any) -> None:
    # Given the keys an earlier release wrote, read at the time it wrote them
    _, ctl, _ = replay
    for scope, key in STREAMS:
        status = ctl.status(scope, key)
        want = corpus["status"][f"{scope}:{key}"]
        # Then every rate counts what it counted then, and the held tasks too
        assert [[str(r.rate), r.algorithm, r.used, r.remaining] for r in status.rates] == want["rates"]
        assert status.held_at_publish == want["held_at_publish"]
    # and its pause and its live limit still hold
    assert ctl.paused_until("corpus-paused") is not None
    assert [str(r) for r in ctl.live_limit("corpus-limited") or ()] == ["5/h"]


def test_a_start_reserved_before_the_deploy_is_claimed_after_it(corpus: dict[str, Any], replay: Any,
                                                              prefix: str) -> None:
    app, ctl, clock = replay
    reserved = [m for m in corpus["messages"] if HEADER in m["headers"]]
    for message in reserved:
        # Given a message sent with a start reserved by the earlier release
        headers = message["headers"]
        state = read_state(_ours(corpus, prefix, headers[HEADER]))
        claim = Reservation.from_header(state.get("r"))
        assert claim is not None, f"this version does not read the reservation in {headers[HEADER]}"
        task = app.tasks[headers["task"]]
        args, kwargs, _ = message["body"]
        spec = declared_spec(task)
        assert spec is not None
        call = ctl.checker.bind_spec(task.name, spec, inspect.signature(task.run), args, kwargs)
        assert state["k"] == state_key(prefix, call.scope, call.key)
        # When it arrives at its reserved start
        clock.now = claim.start_us
        reply = ctl.checker.check(call, reserve=True, claim=claim, claimant=headers["id"], lease=True)
        # Then it runs, on the units reserved for it (a claim it could not use would be
        # checked afresh: no start in the reply)
        assert (reply.code, reply.start_us) == (Code.RUN, claim.start_us), (headers["task"], tuple(reply))
    # and the starts reserved used the window's room: nothing more fits now
    for scope, key in STREAMS:
        assert ctl.status(scope, key).remaining == 0


def test_tasks_parked_before_the_deploy_are_released_after_it(corpus: dict[str, Any], replay: Any) -> None:
    app, ctl, clock = replay
    parked = corpus["keys"]["{parked}:due"]["value"]
    # Given the tasks an earlier release parked, when their time has come
    clock.now = max(due for _, due in parked) + 1
    released = Releaser(ctl).release_once()
    # Then every one is taken and sent back to its queue, as the task it was
    assert released == len(parked)
    sent = [(headers["task"], headers["id"], body[0]) for headers, body in drained(app)]
    messages = corpus["keys"]["{parked}:messages"]["value"]
    bodies = [decode_message(app, _b(value)) for value in messages.values()]
    assert sorted(sent) == sorted((b["task"], b["options"]["task_id"], b["args"]) for b in bodies)
    assert ctl.parking.parked_count() == (0, 0, 0)
