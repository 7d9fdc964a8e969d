"""The per-process lease table (the script side is in test_model_check.py, the worker
side in test_tasks.py)."""

from __future__ import annotations

import threading

from celery_throttle.check.unit_leases import MAX_UNITS, Leases, sent_at


def test_a_key_gets_a_lease_only_once_its_pace_is_known_and_uses_it_up() -> None:
    leases = Leases()
    # Given a key seen for the first time: nothing to take, nothing to ask for
    assert not leases.take("k", 1, slack_us=2000)
    assert leases.wanted("k", 1, span_us=50_000) == 0
    # When it is called again at once (a busy process), it asks for a lease of its pace:
    # the calls it expects within the span (at most MAX_UNITS), times their cost
    assert not leases.take("k", 1, slack_us=2000)
    wanted = leases.wanted("k", 2, span_us=1_000_000)
    assert 2 * 2 <= wanted <= 2 * MAX_UNITS and wanted % 2 == 0
    # And when 3 units are granted for 1 s, exactly 3 calls of cost 1 are admitted
    leases.grant("k", 3, span_us=1_000_000, sent_us=sent_at())
    assert [leases.take("k", 1, slack_us=2000) for _ in range(4)] == [True, True, True, False]
    # And another key (or the same key under other rates) has nothing
    assert not leases.take(("k", "sliding", ()), 1, slack_us=2000)


def test_a_lease_is_not_used_past_its_span_less_the_slack() -> None:
    leases = Leases()
    leases.take("k", 1, slack_us=0)
    # Given 10 units for 30 ms from now
    leases.grant("k", 10, span_us=30_000, sent_us=sent_at())
    # Then a call whose body may start up to 40 ms later may not use them
    assert not leases.take("k", 1, slack_us=40_000)
    # And once dropped, they are gone even for a call that would fit
    assert not leases.take("k", 1, slack_us=0)
    # And a lease that has run out is not used either
    leases.grant("k", 10, span_us=5_000, sent_us=sent_at())
    threading.Event().wait(0.02)
    assert not leases.take("k", 1, slack_us=0)


def test_a_forked_process_does_not_inherit_its_parents_leases() -> None:
    leases = Leases()
    leases.take("k", 1, slack_us=0)
    leases.grant("k", 10, span_us=1_000_000, sent_us=sent_at())
    leases._pid = -1  # as seen from a child forked after the grant
    assert not leases.take("k", 1, slack_us=0)
