"""Consumer-side screening: deny fresh messages before they reach the pool.

A denial in the pool costs a whole task execution (and Celery's ``Ignore`` handling,
several ms of CPU): in a burst of 10x the limit, the pool would spend seconds turning
tasks away while reserved ones wait behind them. So a fresh message of a throttled task
(no ETA, no reservation yet) is checked here first, in the consumer, with one script call
that records nothing if the task fits now; only when it does not fit is a start reserved
and the message re-sent (or parked) and acked, without ever reaching the pool. Whatever
fits, or cannot be screened (bad arguments, Redis down), goes to the pool as usual, where
``before_start`` makes the real, authoritative check.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from celery import bootsteps
from celery.utils.imports import symbol_by_name

from .errors import ThrottleError
from .hook import HEADER, defer_denied
from .keys import state_key
from .store import WindowReply

__all__ = ["ScreenStep"]

logger = logging.getLogger("celery_throttle")


class ScreenStep(bootsteps.StartStopStep):
    """Wraps the consumer's strategy of each throttled task (after they are built)."""

    label = "celery_throttle screen"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        from . import install

        ctl = install(c.app)
        for name, task in c.app.tasks.items():
            if type(task).__dict__.get("_throttle_hooked") and name in c.strategies:
                c.strategies[name] = _screened(ctl, task, c.strategies[name], c.connection_errors)


def _screened(ctl: Any, task: Any, handler: Callable[..., Any], errors: Any) -> Callable[..., Any]:
    Request = symbol_by_name(task.Request)

    def screened(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any) -> Any:
        headers = message.headers or {}
        if "task" not in headers or headers.get("eta") or (headers.get(HEADER) or {}).get("r"):
            return handler(message, body, ack, reject, callbacks, **kw)
        try:
            req = Request(message, app=task.app, task=task)
            args, kwargs = req.args, req.kwargs
            spec = type(task)._throttle_spec
            call = spec.bind(task.name, type(task)._throttle_signature, args or (), kwargs or {},
                             ctl.settings.default_algorithm)
            reply = ctl.check(call, reserve=True, screen=True)
        except ThrottleError:
            # Bad arguments or Redis down: the pool path deals with it, visibly.
            return handler(message, body, ack, reject, callbacks, **kw)
        if reply.code != WindowReply.DENIED or not reply.start_us:
            return handler(message, body, ack, reject, callbacks, **kw)
        context = req._context
        ident = state_key(ctl.settings.key_prefix, call.scope, call.key)
        try:
            defer_denied(ctl, task, context, args, kwargs, call, {}, ident, None, reply)
        except Exception:
            logger.exception("could not defer %s[%s] from the consumer; handing it to the pool",
                             task.name, req.id)
            return handler(message, body, ack, reject, callbacks, **kw)
        ack(logger, errors)
        return None

    return screened
