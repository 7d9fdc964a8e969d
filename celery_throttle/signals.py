"""Signals sent by celery_throttle."""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["task_throttled"]

#: Sent in the worker each time a throttled task is denied and deferred.
#: ``sender`` is the task; keyword arguments: ``request`` (the task's request),
#: ``delay`` (seconds until it comes back), ``scope``, ``key`` (None without a key),
#: ``parked`` (True when the wait was long enough to park the message in Redis).
task_throttled = Signal(
    name="task_throttled",
    providing_args={"request", "delay", "scope", "key", "parked"},
)
