"""The trace swap: the pool's hook (:func:`.hook.guard`) decides before Celery's trace
starts; a task that cannot start now waits in its key's line (:mod:`.deferral` puts it there).

Every execution in a worker, in any pool, goes through the task's ``__trace__`` (the
tracer Celery builds per task, in the consumer and again in each pool child). A hooked
task's class turns that attribute into a property that wraps each tracer it is given:
the wrapper checks first, and a task that must wait is put in its key's line and handed
back to the pool as Celery's own ``Ignore`` would be (acked, nothing stored, nothing logged)
without the trace ever running. So ``task_prerun``/``task_postrun`` see real executions
only. An outcome the trace must report (``WaitTooLong``, a store error under ``fail``, a
re-send the broker refused) is raised from ``before_start``, inside the trace, where
Celery records it as the task's failure or rejection. ``before_start`` also checks by
itself when a tracer was built some other way (a fallback, never the usual path).
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

from celery.exceptions import Ignore

from ..celery_parts.internals import build_task_tracer, deferred_trace_result, has_own, trace_context
from ..check.controller import controller
from ..core.spec import ThrottleSpec
from . import settle
from .backing_off import catching_backoff
from .hook import forget_header_of, guard, holders

__all__ = ["attach", "body_ended"]

logger = logging.getLogger("celery_throttle")


def attach(task: Any, spec: ThrottleSpec) -> None:
    """Make ``task`` check ``spec`` before its body runs (idempotent)."""
    cls = type(task)
    cls._throttle_spec = spec
    if cls.__dict__.get("_throttle_hooked"):
        return
    original = cls.before_start if has_own(task, "before_start") else None

    def before_start(self: Any, task_id: str, args: Any, kwargs: Any) -> None:
        if _decided.task_id == task_id:
            error, _decided.task_id, _decided.error = _decided.error, None, None
            if error is not None:
                raise error
        elif not guard(self, args, kwargs):
            # Raised here, not deeper: Celery copies every frame between its trace
            # and the raise into the ExceptionInfo it builds for Ignore.
            raise Ignore()
        if original is not None:
            original(self, task_id, args, kwargs)

    built = task.__dict__.pop("__trace__", None)
    cls._throttle_signature = _signature(task)
    cls.before_start = before_start
    cls.run = catching_backoff(cls.__dict__.get("run", cls.run), task)
    cls.__trace__ = property(_tracer, _set_tracer)
    cls._throttle_hooked = True
    if built is not None:
        # Hooked after the worker built its tracer (a task defined after the worker
        # started, then reload()): build it again, now with our before_start in it.
        task.__trace__ = build_task_tracer(task)


class _Decided(threading.local):
    """The task id the wrapper just decided to run, in this thread (or greenlet), and
    the error the trace must raise for it, if any."""

    task_id: str | None = None
    error: BaseException | None = None


_decided = _Decided()


class Deferred:
    """What the pool hands back for a task deferred before its trace: Celery reads it
    as an ``Ignore`` (the message is acked, nothing is stored or logged). Picklable:
    a prefork child sends it to the parent."""

    internal = True
    traceback = ""
    exc_info = None

    def __init__(self) -> None:
        self.exception = Ignore()


def _tracer(task: Any) -> Any:
    return task.__dict__.get("_throttle_tracer")


def _set_tracer(task: Any, tracer: Any) -> None:
    task.__dict__["_throttle_tracer"] = None if tracer is None else _deciding(task, tracer)


def _deciding(task: Any, tracer: Any) -> Any:
    """``tracer``, preceded by the throttle's decision."""

    def trace(uuid: str, args: Any, kwargs: Any, request: Any = None) -> Any:
        context = trace_context(request, args, kwargs)
        task.request_stack.push(context)
        error: BaseException | None = None
        try:
            run = guard(task, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the trace reports it, as the task's own outcome
            run, error = True, exc
        finally:
            task.request_stack.pop()
        if not run:
            return deferred_trace_result(Deferred())
        if error is None and isinstance(request, dict):
            forget_header_of(request)
        _decided.task_id, _decided.error = uuid, error
        try:
            return tracer(uuid, args, kwargs, request)
        finally:
            _decided.task_id = _decided.error = None
            body_ended(task, uuid)

    trace.__wrapped__ = tracer  # type: ignore[attr-defined]
    return trace


def body_ended(task: Any, task_id: str) -> None:
    """The body of ``task_id`` ended (however it ended): give its concurrency slot back, if
    this process holds one for it. Never raises: the task's outcome stands."""
    settle.ended(task_id)
    recorder = controller(task.app).recorder
    if recorder.enabled:
        recorder.ended(task_id)
    holder = holders.running.pop(task_id, None)
    if holder is None:
        return
    try:
        controller(task.app).slots.release(holder)
    except Exception as exc:  # noqa: BLE001 - its lease runs out, and the slot is reclaimed
        logger.warning("could not give back the concurrency slot of %s[%s]: %r; it is reclaimed when its lease "
                       "runs out", task.name, task_id, exc)


def _signature(task: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(task.run)
    except (TypeError, ValueError):
        return None
