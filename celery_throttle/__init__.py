"""celery_throttle: global, Redis-backed rate limits for Celery tasks.

>>> ctl = celery_throttle.install(app)
>>> @app.task
... @throttle("10/s", key="{tenant_id}")
... def export(tenant_id): ...
"""

from __future__ import annotations

from . import signals
from .check.limiter import Throttle
from .check.status import Decision, RateStatus, Status
from .core.adapt import Adapt
from .core.backoff import Backoff, backoff_from
from .core.errors import (
    ConfigurationError,
    KeyBuildError,
    ResendRefused,
    StoreError,
    ThrottleError,
    WaitTooLong,
)
from .core.rates import Rate, parse_rate
from .core.share import Share
from .integration.decorator import throttle
from .integration.settle import charge, observe
from .integration.worker import install

__all__ = [
    "Adapt",
    "Backoff",
    "ConfigurationError",
    "Decision",
    "KeyBuildError",
    "Rate",
    "RateStatus",
    "ResendRefused",
    "Share",
    "Status",
    "StoreError",
    "Throttle",
    "ThrottleError",
    "WaitTooLong",
    "__version__",
    "backoff_from",
    "charge",
    "install",
    "observe",
    "parse_rate",
    "signals",
    "throttle",
]

__version__ = "0.1.0"
