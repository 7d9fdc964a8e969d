"""Every private part of Celery the plugin leans on, in one place.

Celery offers no public hook before a task's trace, nor a way to read a task of an app
that is not finalized, nor a request built from a message in the consumer. What the
plugin needs of each lives here, one function per shape, so that a Celery upgrade that
changes one breaks this file, and ``tests/pure/test_internals.py`` (the contract: each shape
asserted on the installed Celery, run by CI on the oldest and newest supported) names
which, in one clear message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from celery.app import trace as celery_trace
from celery.app.trace import TraceInfo, build_tracer, task_has_custom
from celery.local import maybe_evaluate
from celery.states import IGNORED
from celery.utils.imports import symbol_by_name
from celery.worker import state as worker_state
from celery.worker.request import Request

__all__ = [
    "build_task_tracer",
    "chain_on_close",
    "deferred_trace_result",
    "has_own",
    "held_requests",
    "no_process_free",
    "proxied_function",
    "registered_task",
    "request_context_factory",
    "trace_context",
    "worker_hostname",
    "wrap_update_strategies",
]


def worker_hostname() -> str | None:
    """The worker's node name, as Celery keeps it for its own fast tracer
    (``celery.app.trace._localized``, filled by ``setup_worker_optimizations``)."""
    localized = celery_trace._localized
    return localized[2] if len(localized) == 3 else None


def build_task_tracer(task: Any) -> Any:
    """A tracer for ``task`` as the worker builds one (``build_tracer``)."""
    return build_tracer(task.name, task, task.app.loader, worker_hostname(), app=task.app)


def has_own(task: Any, method: str) -> bool:
    """Whether ``task`` defines ``method`` itself, not as Celery's Task does (``task_has_custom``)."""
    return bool(task_has_custom(task, method))


def trace_context(request: Any, args: Any, kwargs: Any) -> Any:
    """The context a tracer pushes on ``task.request_stack`` for one execution."""
    return celery_trace.Context(request or {}, args=args, called_directly=False, kwargs=kwargs)


def deferred_trace_result(retval: Any) -> Any:
    """What a tracer returns for an execution that ended in ``Ignore``: the pool acks the
    message and stores nothing (``trace_ok_t`` with an ``IGNORED`` TraceInfo)."""
    return celery_trace.trace_ok_t(retval, TraceInfo(IGNORED), 0.0, None)


def request_context_factory(task: Any) -> Callable[[Any], Any]:
    """A function from a message of ``task`` to its request context (``task.request``
    as the body would see it), built in the consumer (``Request(...)._context``)."""
    request_class = symbol_by_name(task.Request)

    def context(message: Any) -> Any:
        return request_class(message, app=task.app, task=task)._context

    return context


def proxied_function(proxy: Any) -> Any:
    """The function a lazy ``@app.task`` (a ``PromiseProxy``) will make a task of, or None."""
    try:
        args = object.__getattribute__(proxy, "_Proxy__args")
    except AttributeError:
        return None
    return args[0] if args and callable(args[0]) else None


def registered_task(app: Any, name: str) -> Any:
    """The app's task of that name, without finalizing the app (``app._tasks``). A task
    module imported by a producer that never finalizes holds its ``@app.task`` tasks as
    pending promises (``app._pending``): they are made now, as the first use of any of
    them would."""
    task = app._tasks.get(name)
    if task is None and app._pending:
        for promise in list(app._pending):
            maybe_evaluate(promise)
        task = app._tasks.get(name)
    return task


def wrap_update_strategies(consumer: Any, after: Callable[[], None]) -> None:
    """Run ``after`` each time ``consumer`` builds its task strategies anew (at start,
    and at a reload)."""
    update_strategies = consumer.update_strategies

    def updated() -> None:
        update_strategies()
        after()

    consumer.update_strategies = updated


def chain_on_close(worker: Any, first: Callable[[], None]) -> None:
    """Run ``first`` when ``worker`` closes, warm or cold (a cold stop sends no
    ``worker_shutdown``, but always closes the blueprint), before what ran there."""
    closing = worker.blueprint.on_close

    def on_close() -> None:
        first()
        if closing is not None:
            closing()

    worker.blueprint.on_close = on_close


def held_requests(consumer: Any) -> Iterator[tuple[str, Any]]:
    """The requests a worker holds, with where: ``countdown`` (an ETA in its timer: the
    timer's queue entries, whose first argument is the request), ``running`` and
    ``received`` (``celery.worker.state``'s active and reserved requests)."""
    for waiting in list(consumer.timer.schedule.queue):
        request = (getattr(waiting.entry, "args", None) or (None,))[0]
        if isinstance(request, Request):
            yield "countdown", request
    for where, requests in (("running", worker_state.active_requests), ("received", worker_state.reserved_requests)):
        for request in list(requests):
            yield where, request


def no_process_free(consumer: Any) -> bool:
    """Whether a task this worker's consumer takes now would wait for a pool process:
    as many received and not yet running as the processes not running one (at least one:
    a process whose body just ended counts as running until the pool says it is done, and
    the task its end released should start there). From ``celery.worker.state``'s active
    and reserved requests, and the pool's size (the autoscaler's ceiling when it has one)."""
    limit, running, waiting = _pool_state(consumer)
    return waiting >= max(limit - running, 1)


def processes_idle(consumer: Any) -> int:
    """How many of this worker's pool processes run nothing and have nothing waiting for
    them (see :func:`no_process_free`)."""
    limit, running, waiting = _pool_state(consumer)
    return limit - running - waiting


def _pool_state(consumer: Any) -> tuple[int, int, int]:
    """(the pool's size, the requests running, those received and waiting for a process)."""
    limit = getattr(consumer.controller, "max_concurrency", None) or consumer.pool.num_processes
    running = len(worker_state.active_requests)
    return int(limit), running, len(worker_state.reserved_requests) - running
