"""Priority within a line (celery_throttle/core/priority.py): a message's priority read as
its broker orders its queue, and a throttle's own ``priority=`` checked where it is
declared and bound like a key. (Its place in the line: tests/script/test_priority_line.py.)"""

from __future__ import annotations

import pytest

import celery_throttle
from celery_throttle.core.errors import ConfigurationError, KeyBuildError
from celery_throttle.core.priority import urgency
from celery_throttle.core.spec import ThrottleSpec


@pytest.mark.parametrize(("priority", "lowest_first", "expected"), [
    (None, False, 0), (0, False, 0), (9, False, 9), (300, False, 255), (-4, False, 0), ("x", False, 0),
    (True, False, 0),
    # Redis runs 0 first (a message without one: as 0), 9 last
    (None, True, 0), (0, True, 0), (3, True, -3), (9, True, -9), (42, True, -9),
])
def test_a_messages_priority_is_read_as_its_broker_orders_its_queue(priority: object, lowest_first: bool,
                                                                    expected: int) -> None:
    assert urgency(priority, lowest_first) == expected


def test_a_throttles_priority_is_checked_where_it_is_declared_and_bound_like_a_key() -> None:
    # A number out of range, or not a number, fails at import
    for bad in (256, "high", 1.5, True):
        with pytest.raises(ConfigurationError, match="priority must be an int from -255 to 255"):
            celery_throttle.throttle("1/s", priority=bad)
    with pytest.raises(ConfigurationError, match=r"throttle_rules\['x'\]: priority must be an int"):
        ThrottleSpec.from_rule("x", {"rate": "1/s", "priority": "urgent"})

    # A callable binds the task's arguments by name, called positionally or by keyword
    def body(tenant: str, kind: str) -> None: ...

    spec = ThrottleSpec.declare(["1/s"], key="{tenant}", priority=lambda kind, **_: 5 if kind == "reset" else 0)
    spec.check_signature(body, "task t")
    import inspect

    signature = inspect.signature(body)
    assert spec.bind("t", signature, ("acme", "reset"), {}, "sliding", "p").priority == 5
    assert spec.bind("t", signature, (), {"tenant": "acme", "kind": "export"}, "sliding", "p").priority == 0
    # one that cannot take them fails at import; one that answers out of range, at run time
    bad = ThrottleSpec.declare(["1/s"], priority=lambda level: level)
    with pytest.raises(ConfigurationError, match="the priority callable takes"):
        bad.check_signature(body, "task t")
    wild = ThrottleSpec.declare(["1/s"], priority=lambda kind, **_: 1000)
    with pytest.raises(KeyBuildError, match="priority callable's answer must be an int"):
        wild.bind("t", signature, ("acme", "reset"), {}, "sliding", "p")
    # and without one, the message's priority says (None)
    assert ThrottleSpec.declare(["1/s"]).bind("t", signature, ("a", "b"), {}, "sliding", "p").priority is None
