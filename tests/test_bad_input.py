"""Messages a worker may receive from anyone: our header in any shape never crashes it."""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from celery_throttle.keys import parking_keys
from celery_throttle.protocol import HEADER, Reservation, header_value, read_state
from tests.helpers import WorkerGroup, max_in_window

#: What a JSON (or msgpack, or pickle-less YAML) body can carry.
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=8), inner, max_size=8),
    max_leaves=30,
)


@given(JSONISH)
def test_any_header_value_reads_as_a_state_or_as_nothing(value: Any) -> None:
    # When any value stands where our header goes
    state = read_state(value)
    # Then it reads, without raising, as known fields of the right types only
    assert set(state) <= {"k", "r", "n", "e", "p", "w"}
    assert isinstance(state.get("k", ""), str)
    assert "r" not in state or Reservation.from_header(state["r"]) is not None
    assert all(isinstance(state[c], int) and state[c] >= 0 for c in ("n", "e", "p", "w") if c in state)


@given(st.dictionaries(st.sampled_from(["k", "r", "n", "e", "p", "w", "x"]), JSONISH, max_size=7))
def test_a_header_with_our_keys_and_any_values_never_raises(value: dict[str, Any]) -> None:
    read_state(value)


@given(st.lists(st.integers(0, 2**53 - 1), min_size=6, max_size=6), st.text(min_size=1), st.integers(0, 99))
def test_a_header_we_wrote_reads_back_the_same(fields: list[int], key: str, count: int) -> None:
    fields[2] = max(fields[2], 1)  # a cost
    written = {"k": key, "r": Reservation(*fields).to_header(), "n": count, "w": fields[0]}
    assert read_state(written) == written


@given(st.lists(st.integers(0, 2**53 - 1), min_size=6, max_size=6), st.lists(st.integers(1, 10**6), min_size=2,
                                                                             max_size=5))
def test_a_reservation_with_a_cost_per_rate_reads_back_and_is_written_as_format_2(fields: list[int],
                                                                                 costs: list[int]) -> None:
    # Given a reservation of a call whose rates count different units (a cost per rate)
    per_rate = Reservation(fields[0], fields[1], tuple(costs), *fields[3:])
    # When it is written in a header, and read back
    written = header_value({"k": "key", "r": per_rate.to_header()})
    # Then it reads back as it was, in format 2 (one with one cost stays format 1, which
    # a deploy rolled back reads too)
    assert written["v"] == 2 and Reservation.from_header(read_state(written)["r"]) == per_rate
    one = Reservation(fields[0], fields[1], costs[0], *fields[3:])
    assert header_value({"r": one.to_header()})["v"] == 1
    # and a list that is not a cost per rate (a single one, a zero, a float) is no reservation
    for bad in ([costs[0]], [*costs[:1], 0], [*costs[:1], 1.5]):
        assert Reservation.from_header([fields[0], fields[1], bad, *fields[3:]]) is None


def test_messages_with_a_garbled_header_run_throttled_and_no_worker_falls(workers: WorkerGroup) -> None:
    # Given a 5/s task, and messages whose celery_throttle header is not what we write
    label = uuid.uuid4().hex[:10]
    garbage: list[Any] = ["a string", ["a", "list"], 42, None, {"k": 1, "r": "x", "n": "many"},
                          {"r": [1, 2, 3]}, {"k": "nope", "r": [1, 2, 3, 4, 5, 6], "e": -3}]
    # When 14 of them are sent at once
    ids = [workers.send("below", label, headers={HEADER: value}) for value in garbage * 2]
    # Then each ran once, as a fresh call, within the limit, and every worker is still up
    starts = workers.wait_starts(label, len(ids), timeout=30)
    assert sorted(e["id"] for e in starts) == sorted(ids)
    assert max_in_window([e["t"] for e in starts], 1.0) <= 5
    assert all(proc is not None and proc.poll() is None for proc in workers.procs)


# -- parked messages --------------------------------------------------------------------
def _parking_app(prefix: str) -> Any:
    from celery import Celery

    import celery_throttle
    from tests.helpers import BROKER_URL, STORE_URL

    app = Celery(f"parking-{prefix}", broker=BROKER_URL, set_as_current=False)
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
def test_a_parked_message_reads_back_as_it_was_written(args: Any, kwargs: Any) -> None:
    from celery import Celery, signature

    from celery_throttle.messages import decode_message, encode_message

    app = Celery("roundtrip", set_as_current=False)
    sig = signature("proj.task", args=[args], kwargs={"value": kwargs}, app=app,
                    task_id="t-1", headers={HEADER: {"n": 1}}, queue="q", countdown=3)
    body = decode_message(app, encode_message(app, sig))
    assert body["task"] == "proj.task" and body["args"] == [args] and body["kwargs"] == {"value": kwargs}
    assert body["options"]["task_id"] == "t-1" and "countdown" not in body["options"]


def test_any_bytes_parked_never_stop_the_releaser_and_end_as_dead_letters(prefix: str) -> None:
    from hypothesis import settings

    from celery_throttle.parking import MAX_ATTEMPTS, Releaser

    app, ctl = _parking_app(prefix)
    releaser = Releaser(ctl)

    @settings(max_examples=40, deadline=None)
    @given(st.binary(max_size=200) | st.text(max_size=80).map(lambda t: f"application/json\nutf-8\n{t}".encode()))
    def check(blob: bytes) -> None:
        # Given a parked entry holding any bytes at all (a foreign writer, a truncation)
        ctl.parking.drop_dead([parked_id for parked_id, *_ in ctl.parking.dead_letters()])
        ctl.parking.park(f"junk-{uuid.uuid4().hex}", 0, blob)
        # When the releaser meets it again and again
        due = parking_keys(prefix)[0]
        handed_out = 0
        while ctl.parking.parked_count()[2] == 0 and handed_out <= MAX_ATTEMPTS:
            releaser.release_once()  # never raises
            handed_out += 1
            waiting = ctl.store.client.zrange(due, 0, -1)
            if waiting:
                ctl.store.client.zadd(due, dict.fromkeys(waiting, 0))  # due again now
        # Then after MAX_ATTEMPTS tries it is a dead letter: not back forever, not lost
        assert ctl.parking.parked_count() == (0, 0, 1)
        assert handed_out == MAX_ATTEMPTS + 1  # the last hand-out finds it spent

    try:
        check()
    finally:
        ctl.close()
        app.close()
