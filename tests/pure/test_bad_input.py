"""Messages a worker may receive from anyone: our header in any shape never crashes it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from hypothesis import assume, given
from hypothesis import strategies as st

from celery_throttle.core.header import HEADER, HEADER_VERSION, Header
from tests.helpers import WorkerGroup, max_started_in

#: What a JSON (or msgpack, or pickle-less YAML) body can carry.
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=8), inner, max_size=8),
    max_leaves=30,
)


@given(JSONISH)
def test_any_header_value_reads_as_a_header_or_as_nothing(value: Any) -> None:
    # When any value stands where our header goes
    header = Header.read(value)
    # Then it reads, without raising, as fields of the right types and bounded sizes only
    assert isinstance(header.key, str) and isinstance(header.ticket, str)
    assert len(header.key) <= 1024 and len(header.ticket) <= 1024
    assert 0 <= header.deferrals <= 2**20 and 0 <= header.errors <= 2**20


@given(st.dictionaries(st.sampled_from(["k", "t", "n", "e", "v", "r", "w", "p", "x"]), JSONISH, max_size=8))
def test_a_header_with_our_keys_and_any_values_never_raises(value: dict[str, Any]) -> None:
    Header.read(value)


@given(st.text(min_size=1, max_size=200), st.text(min_size=1, max_size=60), st.integers(0, 2**20),
       st.integers(0, 2**20))
def test_a_header_we_wrote_reads_back_the_same(key: str, ticket: str, deferrals: int, errors: int) -> None:
    written = Header(key, ticket, deferrals, errors)
    assert Header.read(written.value()) == written


def test_a_header_of_another_format_reads_as_nothing() -> None:
    # A header of a development format (1 or 2, never released), or with no format, is
    # read as absent: the task is checked as a new one
    assert Header.read({"k": "s", "r": [1, 2, 1, 3, 4, 5], "n": 2}) == Header()
    assert Header.read({"v": 2, "k": "s", "t": "ticket", "n": 1}) == Header()
    # and so is a header of a later format (a deploy rolled back)
    assert Header.read({"v": HEADER_VERSION + 1, "k": "s", "t": "ticket"}) == Header()
    # while this format's reads whole
    assert Header.read({"v": HEADER_VERSION, "k": "s", "t": "ticket", "n": 1}) == Header("s", "ticket", 1)


@pytest.mark.workers
def test_messages_with_a_garbled_header_run_throttled_and_no_worker_falls(workers: WorkerGroup) -> None:
    # Given a 5/s task, and messages whose celery_throttle header is not what we write
    label = uuid.uuid4().hex[:10]
    garbage: list[Any] = ["a string", ["a", "list"], 42, None, {"k": 1, "r": "x", "n": "many"},
                          {"r": [1, 2, 3]}, {"k": "nope", "r": [1, 2, 3, 4, 5, 6], "e": -3},
                          {"v": 3, "k": "nope", "t": "forged", "n": 2**62, "e": 2**62}]
    # When 14 of them are sent at once
    ids = [workers.send("below", label, headers={HEADER: value}) for value in garbage * 2]
    # Then each ran once, as a fresh call, within the limit, and every worker is still up. (The
    # starts are the bodies' own notes, taken after their claim: beside the rest of the suite a
    # body may note its start late and bunch with the next window's, so the window looked at is
    # a little shorter than the limit's; 14 run unthrottled would all be in it.)
    starts = workers.wait_starts(label, len(ids), timeout=30)
    assert sorted(e["id"] for e in starts) == sorted(ids)
    assert max_started_in([e["t"] for e in starts], 0.8) <= 5
    assert all(proc is not None and proc.poll() is None for proc in workers.procs)


# -- kept messages ---------------------------------------------------------------------
def _kept_app(prefix: str) -> Any:
    from celery import Celery

    import celery_throttle
    from tests.helpers import BROKER_URL, STORE_URL

    app = Celery(f"kept-{prefix}", broker=BROKER_URL, set_as_current=False)
    app.conf.task_default_queue = f"{prefix}-q"
    return app, celery_throttle.install(app, redis_url=STORE_URL, key_prefix=prefix)


#: JSON values that equal themselves (NaN does not).
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=8), inner, max_size=8),
    max_leaves=30,
)


@given(JSON_VALUES, JSON_VALUES)
def test_a_kept_message_reads_back_as_it_was_written(args: Any, kwargs: Any) -> None:
    from celery import Celery, signature

    from celery_throttle.celery_parts.messages import decode_message, encode_message

    app = Celery("roundtrip", set_as_current=False)
    sig = signature("proj.task", args=[args], kwargs={"value": kwargs}, app=app,
                    task_id="t-1", headers={HEADER: {"n": 1}}, queue="q", countdown=3)
    body = decode_message(app, encode_message(app, sig))
    assert body["task"] == "proj.task" and body["args"] == [args] and body["kwargs"] == {"value": kwargs}
    assert body["options"]["task_id"] == "t-1" and "countdown" not in body["options"]


def _readable(app: Any, blob: bytes) -> bool:
    from celery_throttle.celery_parts.messages import task_of

    try:
        task_of(app, blob)
    except Exception:  # noqa: BLE001 - what the release meets: a message no serializer reads
        return False
    return True


@pytest.mark.script
def test_any_bytes_waiting_in_a_line_never_stop_its_release_and_end_as_a_dead_letter(prefix: str) -> None:
    from hypothesis import settings

    from celery_throttle.core.protocol import Code, Entry

    app, ctl = _kept_app(prefix)
    call = ctl._direct_call("junk", None, "1/h", 1, None)
    assert ctl.checker.acquire(call).allowed  # (full for the hour: every entry waits)

    @settings(max_examples=40, deadline=None)
    @given(st.binary(min_size=1, max_size=200) | st.text(max_size=80).map(lambda t: f"application/json\nutf-8\n{t}".encode()))
    def check(blob: bytes) -> None:
        assume(not _readable(app, blob))  # (a kept task after all is sent on as one)
        # Given a line whose head's message holds any bytes at all (a foreign writer, a truncation)
        ctl.store.drop_dead([letter_id for letter_id, *_ in ctl.store.dead_letters()])
        entry = f"junk-{uuid.uuid4().hex}:x"
        assert ctl.checker.acquire(call, entry=Entry(entry, blob, "junk", 0, 0, 1)).code == Code.QUEUED
        # When its line is released (drained: whatever the window says)
        ctl.lines.handle(call, ctl.checker.release(call, 8, drain=True))  # never raises
        # Then it is a dead letter, as it was: not back in its line, not lost
        assert [(i, m) for i, _, m in ctl.store.dead_letters()] == [(entry, blob)]
        assert not ctl.lines.waiting()

    try:
        check()
    finally:
        ctl.close()
        app.close()


def test_a_kept_message_decodes_as_one_task_whatever_else_it_names() -> None:
    from kombu.serialization import dumps

    from celery_throttle.celery_parts.messages import KEPT_FIELDS, decode_message

    app = Celery("kept", set_as_current=False)
    # Given a stored message that also names a chord (a writer of the store's own)
    body = {"task": "tests.taskapp.record_start", "args": ["x"], "kwargs": {}, "options": {},
            "subtask_type": "chord", "chord_size": 2}
    content_type, encoding, data = dumps(body, serializer="json")
    message = content_type.encode() + b"\n" + encoding.encode() + b"\n" + data.encode()
    # Then it reads as the one task it holds, and is sent on as that task
    decoded = decode_message(app, message)
    assert tuple(decoded) == KEPT_FIELDS
    assert type(app.signature(decoded)).__name__ == "Signature"
