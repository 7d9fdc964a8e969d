"""Where an app's :class:`~celery_throttle.check.limiter.Throttle` lives: one per app, made on
first use. Everything that needs it looks it up here; wiring it into Celery (worker
steps, task hooks) is :func:`celery_throttle.install`'s job (worker.py)."""

from __future__ import annotations

from typing import Any

from ..core.locks import ForkSafeLock
from .limiter import Throttle

__all__ = ["controller"]

_ATTRIBUTE = "_celery_throttle"
_lock = ForkSafeLock()


def controller(app: Any) -> Throttle:
    """The app's controller (made now if it has none yet)."""
    ctl: Throttle | None = app.__dict__.get(_ATTRIBUTE)
    if ctl is None:
        with _lock:
            ctl = app.__dict__.get(_ATTRIBUTE)
            if ctl is None:
                ctl = Throttle(app)
                setattr(app, _ATTRIBUTE, ctl)
    return ctl
