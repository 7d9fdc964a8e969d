"""Priority within a key's line: how far ahead of its broker's default a task goes.

A task's urgency is the levels of priority it stands ahead of a task its broker gives no
priority (negative: behind), as its broker orders them, so that the line keeps the order
the queue would have kept: an AMQP broker (RabbitMQ) runs the highest priority first, 0 to
255, a message without one at 0; Redis (kombu's transport) runs 0 first and 9 last, a
message without one at 0. A throttle's own ``priority=`` (a number or a callable over the
task's arguments, higher first) takes the place of the message's.

The line keeps it by place (line.lua's ``place_of``): a task of urgency u joins before the
``u * PRIORITY_STEP`` tasks that came last before it (``ScriptPolicy``), one of urgency -u
after the ``u * PRIORITY_STEP`` that come next, first come first served within a level. That is the aging rule: priority is bounded overtaking,
so a task of urgency u waits behind fewer than ``(v - u) * PRIORITY_STEP`` of the tasks
that came after it, v the highest urgency among them (at most ``2 * MOST_URGENCY`` levels),
however many urgent ones keep coming.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigurationError

__all__ = ["MOST_URGENCY", "REDIS_LEVELS", "check_urgency", "place_of", "urgency"]

#: Levels ahead of (or behind) a broker's default, at most: AMQP's 255 (window.lua's
#: MOST_URGENCY is the same, from timing.ScriptPolicy).
MOST_URGENCY = 255
#: The priorities kombu's Redis transport knows: 0 (first, and a message without one) to 9.
REDIS_LEVELS = 9


def urgency(priority: Any, lowest_first: bool) -> int:
    """The urgency of a message's ``priority`` (None: it has none) on a broker that runs the
    lowest first (Redis) or the highest (AMQP). A value that is not a number counts as none."""
    if priority is None or isinstance(priority, bool):
        return 0
    try:
        level = int(priority)
    except (TypeError, ValueError):
        return 0
    if lowest_first:
        return -max(0, min(level, REDIS_LEVELS))
    return max(0, min(level, MOST_URGENCY))


def check_urgency(value: Any, what: str) -> int:
    """A throttle's own priority (higher first), checked."""
    if isinstance(value, bool) or not isinstance(value, int) or not -MOST_URGENCY <= value <= MOST_URGENCY:
        raise ConfigurationError(f"{what} must be an int from {-MOST_URGENCY} to {MOST_URGENCY} (higher first), "
                                 f"got {value!r}")
    return value


def place_of(given: int, urgency: int, step: int) -> float:
    """A task's place in its line, given counter ``given``: line.lua's ``place_of`` (the
    script is the one that places; ``throttle simulate`` replays it)."""
    if urgency == 0:
        return given
    return given - urgency * step - (0.5 if urgency > 0 else -0.5)
