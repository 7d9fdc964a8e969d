"""celery_throttle: global, Redis-backed rate limits for Celery tasks.

>>> ctl = celery_throttle.install(app)
>>> @app.task
... @throttle("10/s", key="{tenant_id}")
... def export(tenant_id): ...
"""

from __future__ import annotations

from typing import Any

from . import signals, worker
from .backoff import Backoff, backoff_from
from .decorator import throttle
from .errors import ConfigurationError, KeyBuildError, StoreError, ThrottleError, WaitTooLong
from .limiter import Decision, RateStatus, Status, Throttle
from .rates import Rate, parse_rate

__all__ = [
    "Backoff",
    "ConfigurationError",
    "Decision",
    "KeyBuildError",
    "Rate",
    "RateStatus",
    "Status",
    "StoreError",
    "Throttle",
    "ThrottleError",
    "WaitTooLong",
    "__version__",
    "backoff_from",
    "install",
    "parse_rate",
    "signals",
    "throttle",
]

__version__ = "0.1.0"


def install(app: Any, **overrides: Any) -> Throttle:
    """Wire celery_throttle into ``app`` and return its :class:`Throttle` controller.

    Idempotent and safe at import time of the app module: settings (``throttle_*`` in
    ``app.conf``, ``overrides`` without the prefix win) are read on first use. Adds a
    worker bootstep that hooks every throttled task (``@throttle`` or
    ``throttle_rules``) before the pool starts, and releases parked long waits.
    """
    ctl = app.__dict__.get("_celery_throttle")
    if ctl is None:
        # (imported here: every throttled task start looks its controller up through
        # install(), and an import statement costs more than the lookup)
        from .screen import ScreenStep
        from .worker import ThrottleStep

        ctl = Throttle(app, overrides)
        app._celery_throttle = ctl
        app.steps["worker"].add(ThrottleStep)
        app.steps["consumer"].add(ScreenStep)
        app.on_after_finalize.connect(ctl.patch_tasks, weak=False)
        if app.finalized:
            ctl.patch_tasks()  # (the signal has fired already: tasks are hooked now)
        worker.attach_to_running_workers(ctl)
    elif overrides:
        ctl.configure(overrides)
    if overrides:
        _ = ctl.settings  # bad overrides fail here, at the call site
    return ctl
