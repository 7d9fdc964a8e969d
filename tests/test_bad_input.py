"""Messages a worker may receive from anyone: our header in any shape never crashes it."""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from celery_throttle.deferral import HEADER, read_state
from celery_throttle.store import Reservation
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
    assert set(state) <= {"k", "r", "n", "e"}
    assert isinstance(state.get("k", ""), str)
    assert "r" not in state or Reservation.from_header(state["r"]) is not None
    assert all(isinstance(state[c], int) and state[c] >= 0 for c in ("n", "e") if c in state)


@given(st.dictionaries(st.sampled_from(["k", "r", "n", "e", "x"]), JSONISH, max_size=5))
def test_a_header_with_our_keys_and_any_values_never_raises(value: dict[str, Any]) -> None:
    read_state(value)


@given(st.lists(st.integers(0, 2**53 - 1), min_size=6, max_size=6), st.text(min_size=1), st.integers(0, 99))
def test_a_header_we_wrote_reads_back_the_same(fields: list[int], key: str, count: int) -> None:
    fields[2] = max(fields[2], 1)  # a cost
    written = {"k": key, "r": Reservation(*fields).to_header(), "n": count}
    assert read_state(written) == written


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
