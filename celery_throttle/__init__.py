"""celery_throttle: global, Redis-backed rate limits for Celery tasks.

>>> ctl = celery_throttle.install(app)
>>> @app.task
... @throttle("10/s", key="{tenant_id}")
... def export(tenant_id): ...
"""

from __future__ import annotations

from . import signals
from .backoff import Backoff, backoff_from
from .decorator import throttle
from .errors import ConfigurationError, KeyBuildError, ResendRefused, StoreError, ThrottleError, WaitTooLong
from .limiter import Decision, RateStatus, Status, Throttle
from .rates import Rate, parse_rate
from .settle import charge
from .worker import install

__all__ = [
    "Backoff",
    "ConfigurationError",
    "Decision",
    "KeyBuildError",
    "Rate",
    "RateStatus",
    "ResendRefused",
    "Status",
    "StoreError",
    "Throttle",
    "ThrottleError",
    "WaitTooLong",
    "__version__",
    "backoff_from",
    "charge",
    "install",
    "parse_rate",
    "signals",
    "throttle",
]

__version__ = "0.1.0"
