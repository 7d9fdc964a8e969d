"""The ``@throttle`` decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.app.task import Task
from celery.local import PromiseProxy, Proxy

from ..celery_parts.internals import proxied_function
from ..core.adapt import Adapt
from ..core.cost import CostArg
from ..core.errors import ConfigurationError
from ..core.share import Share
from ..core.spec import RateArg, ThrottleSpec, declared_spec
from .trace import attach

__all__ = ["throttle"]


def throttle(
    *rates: RateArg,
    key: str | Callable[..., Any] | None = None,
    scope: str | None = None,
    cost: CostArg = 1,
    algorithm: str | None = None,
    max_wait: float | None = None,
    margin: float | None = None,
    concurrency: int | None = None,
    cost_after: Callable[[Any], Any] | None = None,
    adapt: bool | Adapt | dict[str, float] | None = None,
    share: bool | Share | dict[str, Any] | None = None,
    mode: str | None = None,
    priority: int | Callable[..., Any] | None = None,
) -> Callable[[Any], Any]:
    """Limit a task globally, across every worker, before its body runs.

    Use above or below ``@app.task``, or below ``@shared_task``::

        @app.task
        @throttle("10/s", "5000/h", key="{tenant_id}", scope="github-api")
        def sync(tenant_id, repo): ...

    ``rates``: one or more rate strings (all must admit a call), or one callable over
    the task's arguments returning them. ``key``: a format string over the task's
    arguments, or a callable returning a string. ``scope``: the name the limit is stored
    under (default: the task's name). ``cost``: units per call (int or callable); for
    rates of named units (``"30000 tokens/m"``), by unit: ``cost={"tokens": estimate}``
    (a unit not named costs 1).
    ``algorithm``: ``"sliding"`` or ``"fixed"`` (default: ``throttle_default_algorithm``).
    ``max_wait``: seconds; a denied call whose start would be further away fails with
    :class:`~celery_throttle.core.errors.WaitTooLong` instead of waiting (default:
    ``throttle_max_wait``, no cap). ``margin``: seconds added to each sliding window, so
    that requests made by the tasks still arrive a window apart at an API that limits
    them (default: ``throttle_margin``, itself by default 2% of each window, at most 20 ms:
    :data:`.timing.MARGIN_SHARE`, :data:`.timing.MARGIN_MAX_US`; ``0``: none). ``concurrency``: at most this many bodies of
    the scope and key run at once, across every worker (a slot, held from the body's
    start to its end; with rates or without). ``cost_after``: a callable over the body's
    result returning what the call really cost; the window then counts that instead of
    ``cost`` (as :func:`celery_throttle.charge` in the body does). ``adapt``: the rates are
    a ceiling, and the limit in force learns the downstream: lowered on each
    :class:`~celery_throttle.Backoff` (a 429, a 503), raised again while none comes, shared by
    every worker (``True``, or :class:`~celery_throttle.Adapt` for its floor and pace).
    ``share``: ``concurrency`` is the scope's, handed to its keys that have work by weight,
    and wholly to a key alone (``True``: weight 1 each, or :class:`~celery_throttle.Share`
    for a weight per key and a cap per key). ``mode``: ``"shadow"`` counts and reports
    what the throttle would hold back (signal ``task_shadow_throttled``, metrics, the
    summary, ``throttle status``) and holds nothing; ``"enforce"`` holds (default:
    ``throttle_mode``; live, for every worker within a second: ``Throttle.set_mode``).
    ``priority``: where a call joins its key's line, higher first (an int from -255 to 255,
    or a callable over the task's arguments), in place of the message's own priority (which
    orders the line by default, as its broker orders its queue). Mistakes raise :class:`~celery_throttle.core.errors.ConfigurationError` here.
    """
    spec = ThrottleSpec.declare(rates, key=key, scope=scope, cost=cost, algorithm=algorithm,
                                max_wait=max_wait, margin=margin, concurrency=concurrency, cost_after=cost_after,
                                adapt=adapt, share=share, mode=mode,
                                priority=priority)

    def decorate(obj: Any) -> Any:
        if isinstance(obj, PromiseProxy):
            # @throttle above a lazy @app.task: hook the task once Celery creates it.
            fun = proxied_function(obj)
            if fun is not None:
                spec.check_signature(fun, f"task function {fun.__qualname__}")
            obj.__then__(_attach_proxied, obj, spec)
            return obj
        if isinstance(obj, Proxy):
            raise ConfigurationError(
                "put @throttle below @shared_task (between it and the function), not above it"
            )
        if hasattr(obj, "__throttle__") or (isinstance(obj, Task) and declared_spec(obj)):
            raise ConfigurationError(
                    "a task takes one @throttle: list several rates in it instead, "
                    'e.g. @throttle("10/s", "5000/h")'
                )
        if isinstance(obj, Task):
            spec.check_signature(obj.run, f"task {obj.name}")
            attach(obj, spec)
            return obj
        if callable(obj):
            spec.check_signature(obj, f"task function {getattr(obj, '__qualname__', obj)}")
            obj.__throttle__ = spec
            return obj
        raise ConfigurationError(f"@throttle decorates a task or a function, not {obj!r}")

    return decorate


def _attach_proxied(proxy: Any, spec: ThrottleSpec) -> None:
    attach(proxy._get_current_object(), spec)


