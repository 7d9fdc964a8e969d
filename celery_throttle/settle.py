"""Costs settled after the call: ``celery_throttle.charge(units)`` in a throttled body, or
``cost_after=`` on the decorator.

A call is counted with its estimate (``cost``) when it is admitted; once the body knows
what it really used (the tokens an LLM reply reports), :func:`charge` replaces that
estimate: the difference is added to (a refund: taken from) the span the window counted
the call in (window.lua's ``settle``), so a refund lets later starts in sooner and an
overrun pushes them out. The window then holds at most N *reported* units in any
window, estimates standing in until the report. A call admitted from a process's lease
(a busy key far under its limit) keeps a refund counted (where in the lease it counts is
not known) and counts an overrun from the report.

The hook notes, in the thread (or greenlet) that runs the body, where the call was
counted; :func:`charge` reads it there.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from celery import current_task

from .controller import controller
from .errors import StoreError, ThrottleError
from .protocol import Counted
from .spec import BoundCall

__all__ = ["charge"]

logger = logging.getLogger("celery_throttle")


@dataclass
class _Running:
    task_id: str
    call: BoundCall
    counted: Counted
    #: The units the window counts the call with now.
    units: int


class _Bodies(threading.local):
    running: dict[str, _Running]

    def __init__(self) -> None:
        self.running = {}


_bodies = _Bodies()


def started(task_id: str, call: BoundCall, counted: Counted | None) -> None:
    """The hook admitted ``task_id`` (in this thread), counted as ``counted``."""
    if counted is not None:
        _bodies.running[task_id] = _Running(task_id, call, counted, counted.units)


def ended(task_id: str) -> None:
    _bodies.running.pop(task_id, None)


def charge(units: int) -> None:
    """Report what this throttled body really used: ``units`` replace the estimate its
    ``cost`` was counted with (call it again to correct it; the last report stands).

    Raises :class:`~celery_throttle.errors.ThrottleError` outside the body of a
    throttled task, or for a unit count that is not an integer >= 0. A store that cannot
    be reached is logged, not raised: the body's own outcome stands.
    """
    if isinstance(units, bool) or not isinstance(units, int) or units < 0:
        raise ThrottleError(f"charge() takes the units used, an integer >= 0, got {units!r}")
    request = getattr(current_task, "request", None)
    task_id = getattr(request, "id", None)
    running = _bodies.running.get(task_id) if task_id else None
    if running is None:
        raise ThrottleError("charge() is called in the body of a task with a @throttle (or a rule), "
                            "while it runs; this is not one")
    delta = units - running.units
    if delta == 0:
        return
    ctl = controller(current_task.app)
    try:
        ctl.checker.settle(running.call, running.counted, delta)
    except StoreError as exc:
        ctl.metrics.store_error("settle")
        logger.warning("could not settle the cost of %s[%s] (%d units, estimated %d): %s", current_task.name,
                       task_id, units, running.units, exc)
        return
    running.units = units


def charge_after(spec_cost_after: Any, result: Any, task: Any) -> None:
    """``cost_after(result)`` of a body that returned, charged; a cost_after that fails
    or answers something else is logged (the task's result stands)."""
    try:
        units = spec_cost_after(result)
        charge(units)
    except Exception as exc:  # noqa: BLE001 - the result stands; the estimate stays counted
        logger.warning("cost_after of %s[%s] failed (%r): its estimate stays counted", task.name,
                       getattr(task.request, "id", None), exc)
