"""Signals sent by celery_throttle."""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["task_shadow_throttled", "task_throttled", "task_wait_exceeded"]

#: Sent in the worker each time a throttled task is denied and deferred.
#: ``sender`` is the task; keyword arguments: ``request`` (the task's request),
#: ``delay`` (seconds until it comes back), ``scope``, ``key`` (None without a key),
#: ``reason`` (``"rate"``: a rate denied it; ``"concurrency"``: every slot was taken, and it waits
#: for one off the queue, ``delay`` None: it comes back when a slot is handed to it).
task_throttled = Signal(
    name="task_throttled",
    providing_args={"request", "delay", "scope", "key", "reason"},
)

#: Sent in the worker when a denied task would wait longer than its ``max_wait``: it
#: fails with :class:`~celery_throttle.core.errors.WaitTooLong` instead. ``sender`` is the
#: task; keyword arguments: ``request``, ``wait`` (seconds it would have waited),
#: ``max_wait``, ``scope``, ``key``.
task_wait_exceeded = Signal(
    name="task_wait_exceeded",
    providing_args={"request", "wait", "max_wait", "scope", "key"},
)

#: Sent in the worker when a throttle in shadow mode would have held a task back; the task
#: runs now all the same. ``sender`` is the task; keyword arguments: ``request``, ``delay``
#: (seconds it would have waited: 0 for a slot, whose wait is not known), ``scope``,
#: ``key``, ``reason`` (``"rate"``, ``"concurrency"``: K bodies of its key ran already,
#: ``"pause"``, ``"max_wait"``: it would have failed with WaitTooLong, or ``"cost"``: its
#: cost never fits its rates, and it would have failed).
task_shadow_throttled = Signal(
    name="task_shadow_throttled",
    providing_args={"request", "delay", "scope", "key", "reason"},
)
