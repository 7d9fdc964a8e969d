"""A producer's hints (celery_throttle.check.hints): what it may send unchecked at publish, and
the budget it never sends past, whatever the order of its sends or its threads."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_throttle.check.hints import Hints

SEND, RESERVE, ASK = Hints.SEND, Hints.RESERVE, Hints.ASK


def test_a_key_with_no_hint_is_checked() -> None:
    assert Hints().take("k", 1) == ASK


def test_a_hint_lets_its_budget_go_unchecked_then_reserves_for_the_rest_of_it() -> None:
    hints = Hints()
    hints.open("k", 3, 60)
    assert [hints.take("k", 1) for _ in range(4)] == [SEND, SEND, SEND, RESERVE]
    assert hints.take("k", 1) == RESERVE  # (until the hint ends: no more unchecked)
    assert hints.take("other", 1) == ASK


def test_a_send_costing_more_than_is_left_is_not_taken_from_it() -> None:
    hints = Hints()
    hints.open("k", 5, 60)
    assert [hints.take("k", 3), hints.take("k", 3), hints.take("k", 2)] == [SEND, RESERVE, SEND]
    assert hints.take("k", 1) == RESERVE


def test_a_hint_that_ended_is_forgotten_and_the_key_checked_again() -> None:
    hints = Hints()
    hints.open("k", 10, -1.0)  # (its deadline passed)
    assert hints.take("k", 1) == ASK
    hints.open("k", 1, 60)
    assert hints.take("k", 1) == SEND


def test_a_budget_of_units_per_rate_fits_a_send_while_every_rate_has_room() -> None:
    # A requests-and-tokens call: 2 requests and 10 tokens left
    hints = Hints()
    hints.open("k", (2, 10), 60)
    assert hints.take("k", (1, 6)) == SEND
    assert hints.take("k", (1, 6)) == RESERVE  # (4 tokens left)
    assert hints.take("k", (1, 4)) == SEND
    assert hints.take("k", (1, 0)) == RESERVE  # (no request left)


def test_a_send_of_another_shape_than_the_hint_is_checked() -> None:
    hints = Hints()
    hints.open("k", 5, 60)
    assert hints.take("k", (1, 1)) == ASK  # (a call of other rates: the hint is dropped)
    assert hints.take("k", 1) == ASK


def test_a_negative_budget_sends_nothing_unchecked() -> None:
    hints = Hints()
    hints.open("k", -3, 60)
    hints.open("t", (2, -1), 60)
    assert hints.take("k", 1) == RESERVE
    assert hints.take("t", (1, 0)) == SEND and hints.take("t", (0, 1)) == RESERVE


def test_at_most_the_kept_number_of_keys_are_remembered_the_oldest_dropped() -> None:
    hints = Hints(kept=2)
    for key in ("a", "b"):
        hints.open(key, 5, 60)
    hints.open("a", 5, 60)  # (opened again: the newest)
    hints.open("c", 5, 60)
    assert [hints.take(k, 1) for k in ("a", "b", "c")] == [SEND, ASK, SEND]


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(-2, 20), costs=st.lists(st.integers(1, 5), max_size=40))
def test_no_order_of_sends_goes_past_the_budget(budget: int, costs: list[int]) -> None:
    hints = Hints()
    hints.open("k", budget, 60)
    sent = sum(cost for cost in costs if hints.take("k", cost) == SEND)
    assert sent <= max(budget, 0)
    # and what is left is never given away: a send that fits it is taken
    left = max(budget, 0) - sent
    assert hints.take("k", 1) == (SEND if left >= 1 else RESERVE)


def test_threads_sending_at_once_take_the_budget_exactly_once() -> None:
    # Given one budget of 1 000 sends and 8 threads of a producer sending 200 each
    hints, results = Hints(), []
    hints.open("k", 1000, 60)
    lock, barrier = threading.Lock(), threading.Barrier(8)

    def send() -> None:
        barrier.wait()
        mine = [hints.take("k", 1) for _ in range(200)]
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then exactly the budget went unchecked, the rest reserved
    assert results.count(SEND) == 1000 and results.count(RESERVE) == 600
