"""Errors raised by celery_throttle.

Everything derives from :class:`ThrottleError`. Configuration errors are raised when a
throttle is declared (at import time of the task module) or when the worker starts, never
silently in the middle of a run.
"""

from __future__ import annotations

__all__ = ["ConfigurationError", "KeyBuildError", "ResendRefused", "StoreError", "ThrottleError", "WaitTooLong"]


class ThrottleError(Exception):
    """Root of every error celery_throttle raises."""


class ConfigurationError(ThrottleError, ValueError):
    """A rate, key, cost, algorithm or setting is not valid; the message says what is."""


class KeyBuildError(ThrottleError, ValueError):
    """A task was called with arguments that cannot form its throttle key or cost.

    The task fails visibly (FAILURE state with this error); its message is not dropped.
    """


class StoreError(ThrottleError):
    """The Redis store could not be reached or answered with an error."""


class WaitTooLong(ThrottleError):
    """A denied task's start would be further away than its ``max_wait``.

    The task fails visibly (FAILURE state with this error) instead of waiting; nothing is
    reserved for it. The message names the task, scope, key and the wait it would have had.
    """


class ResendRefused(ThrottleError):
    """The broker kept refusing to take back a task that had to wait (sent back for later
    while the store was unreachable), and its message was acked when the pool took it
    (``acks_late`` off), so no copy is left in the broker.

    The task fails visibly (FAILURE state with this error, which names the broker's
    refusal) after ``RESEND_PATIENCE`` seconds of tries; with ``acks_late`` the message
    goes back to the broker instead, and this is not raised.
    """
