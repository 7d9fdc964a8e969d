"""The task side: decides before Celery's trace starts; a task that cannot start now
waits in its key's line (:mod:`.deferral` puts it there).

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

import functools
import inspect
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore

from .. import signals
from ..celery_parts.internals import build_task_tracer, deferred_trace_result, has_own, trace_context
from ..check.controller import controller
from ..check.slots import holder_id
from ..core.backoff import Backoff
from ..core.errors import StoreError, WaitTooLong
from ..core.header import HEADER, Header
from ..core.protocol import Code
from ..core.spec import BoundCall, ThrottleSpec, declared_spec
from ..waits.deferral import TurnedAway, new_entry_id, own_header
from . import settle

if TYPE_CHECKING:
    from ..check.limiter import Throttle

__all__ = ["HEADER", "attach", "declared_spec"]

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
    cls.run = _catching_backoff(cls.__dict__.get("run", cls.run), task)
    cls.__trace__ = property(_tracer, _set_tracer)
    cls._throttle_hooked = True
    if built is not None:
        # Hooked after the worker built its tracer (a task defined after the worker
        # started, then reload()): build it again, now with our before_start in it.
        task.__trace__ = build_task_tracer(task)


def _catching_backoff(run: Any, task: Any) -> Any:
    """``run`` (a staticmethod, or a method taking the task first) that turns a
    :class:`Backoff` raised by the body into a pause and a re-send."""
    if isinstance(run, staticmethod):
        fun = run.__func__

        @functools.wraps(fun)
        def run_static(*args: Any, **kwargs: Any) -> Any:
            try:
                return _settled(task, fun(*args, **kwargs))
            except Backoff as exc:
                back_off(task, exc, args, kwargs)

        return staticmethod(run_static)

    @functools.wraps(run)
    def run_bound(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return _settled(self, run(self, *args, **kwargs))
        except Backoff as exc:
            back_off(self, exc, args, kwargs)

    return run_bound


def _settled(task: Any, result: Any) -> Any:
    """``result`` of a body, its ``cost_after(result)`` charged first (see :mod:`.settle`)."""
    cost_after = getattr(type(task)._throttle_spec, "cost_after", None)
    if cost_after is not None and not (task.request.is_eager or task.request.called_directly):
        settle.charge_after(cost_after, result, task)
    return result


def back_off(task: Any, exc: Backoff, args: Any, kwargs: Any) -> None:
    """Pause the task's scope (and key) for every worker, and put the task at the front of
    its key's line, to run when the pause is over, its retries untouched. Raises Ignore
    (or ``exc`` for a call that is not a task execution: eager, direct)."""
    request = task.request
    if request.is_eager or request.called_directly:
        raise exc
    ctl = controller(task.app)
    call = ctl.checker.bind(task, args, kwargs)
    key = None if exc.whole_scope else call.key
    try:
        ctl.pause(call.scope, key, exc.seconds)
    except StoreError as error:
        logger.warning("could not pause scope %r for %s[%s]: %s", call.scope, task.name, request.id, error)
    logger.warning("%s[%s] backs off: scope %r%s paused for %.1fs on every worker", task.name, request.id,
                   call.scope, "" if key is None else f" key {key!r}", exc.seconds)
    turned = TurnedAway(ctl, task, request, args, kwargs, call, _header(request))
    try:
        reply = ctl.checker.front(call, turned.entry(with_message=True))
    except StoreError as error:
        # Not kept in its line: sent back for the pause all the same.
        logger.warning("could not put %s[%s] back in its line (%s): it is sent back for the pause", task.name,
                       request.id, error)
        turned.send_back(exc.seconds)
        raise Ignore() from None
    ctl.lines.handle(call, reply)
    turned.waits(reply.wait_us, reason="backoff")
    raise Ignore()


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
            _forget_header_of(request)
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
    holder = _holders.running.pop(task_id, None)
    if holder is None:
        return
    try:
        controller(task.app).slots.release(holder)
    except Exception as exc:  # noqa: BLE001 - its lease runs out, and the slot is reclaimed
        logger.warning("could not give back the concurrency slot of %s[%s]: %r; it is reclaimed when its lease "
                       "runs out", task.name, task_id, exc)


class _Holders(threading.local):
    """The delivery that holds a concurrency slot, by task id, of the bodies this thread
    (or greenlet) runs."""

    running: dict[str, str]

    def __init__(self) -> None:
        self.running = {}


_holders = _Holders()


def _signature(task: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(task.run)
    except (TypeError, ValueError):
        return None


def guard(task: Any, args: Any, kwargs: Any) -> bool:
    """True: run the body now. False: it waits in its key's line (or was sent back)."""
    request = task.request
    if request.is_eager or request.called_directly:
        return True  # direct and eager calls are not task executions: never throttled
    ctl = controller(task.app)
    if not ctl.settings.enabled:
        return True
    spec: ThrottleSpec = type(task)._throttle_spec
    call = ctl.checker.bind(task, args, kwargs)
    header = _header(request)
    max_wait = ctl.checker.max_wait(spec)
    turned = TurnedAway(ctl, task, request, args, kwargs, call, header,
                        max_wait_us=int(max_wait * 1_000_000) if max_wait else 0)
    holder = holder_id(request.id)
    ticket = header.ticket if header.key == call.state_key else ""
    try:
        reply = _check(ctl, call, turned, holder, ticket, stale_ok=True)
        if reply.code == Code.STALE:
            # Released under controls this process had not read yet (a resume, a raised
            # limit within CONTROL_REFRESH), which would send it back to its place: read
            # them now and claim again under them (once: then it goes back if it must).
            ctl.checker.refresh_controls()
            call = turned.call = ctl.checker.bind(task, args, kwargs)
            reply = _check(ctl, call, turned, holder, ticket)
        if ticket and reply.code == Code.DUPLICATE and _redelivered(request):
            # The broker gave this message back (its worker died, or lost its connection,
            # before acking it): its process may have died waiting for the start granted
            # to its ticket. Never dropped then: checked as a new task (at least once, as
            # Celery's acks_late is).
            turned.entry_id = new_entry_id(request.id)
            ticket = ""
            reply = _check(ctl, call, turned, holder, ticket)
        if reply.code == Code.RUN_AT and not _waited_for_start(ctl, call, reply):
            # Woken past what its start allows (a loaded machine): that start is given back,
            # and it is checked again as the task it was released as.
            logger.info("throttled %s[%s] woke too late for the start granted to it; checking again", task.name,
                        request.id)
            reply = ctl.checker.claim(call, ticket or turned.entry_id, holder=holder, granted_us=reply.start_us,
                                      entry=turned.entry(with_message=True))
            ctl.lines.handle(call, reply)
        if ticket and reply.code == Code.QUEUED and ctl.checker.refresh_controls():
            # Released under limits this process had not read yet (one changed within
            # CONTROL_REFRESH: a raised or cleared limit, a resume): it went back to its
            # place under the old ones, so its line is looked at again under the new.
            ctl.lines.wake(call.scope, call.key)
    except StoreError as exc:
        return turned.on_store_error(exc)
    if reply.code in (Code.RUN, Code.RUN_AT):
        _forget_header(request)
        ctl.metrics.admitted(call.scope, call.key)
        settle.started(request.id, call, ctl.checker.counted(call, reply))
        if reply.held:
            _holders.running[request.id] = holder
            ctl.slots.took(holder, call)
        return True
    if reply.code == Code.QUEUED:
        turned.waits(reply.wait_us, reason="concurrency" if call.concurrency and not call.rates else "rate")
        return False
    if reply.code == Code.DUPLICATE:
        # A copy of a task that started lately (sent again after a store error whose reply
        # was lost, or delivered twice): it does not run twice.
        logger.warning("%s[%s] is a copy of a task that started lately in scope %r%s: dropped, not run twice",
                       task.name, request.id, call.scope, "" if call.key is None else f" key {call.key!r}")
        ctl.metrics.store_error("duplicate")
        return False
    if reply.code == Code.TOO_FAR:
        raise _too_long(task, request, call, reply.wait_us / 1e6, max_wait or 0, "would wait", "scope")
    if reply.code == Code.WAITED:
        raise _too_long(task, request, call, reply.waited_us / 1e6, max_wait or 0, "waited",
                        "its turn in the line of scope")
    # (DENIED with its message given: nothing could keep it. Sent back for a moment.)
    logger.warning("throttled %s[%s] could not join its line; sent back for a second", task.name, request.id)
    turned.send_back(1.0)
    return False


def _redelivered(request: Any) -> bool:
    return bool((getattr(request, "delivery_info", None) or {}).get("redelivered"))


def _check(ctl: Throttle, call: BoundCall, turned: TurnedAway, holder: str, ticket: str,
           stale_ok: bool = False) -> Any:
    """The call's check: its claim (a released task, with its ``ticket``; ``stale_ok``:
    see :meth:`.Checker.claim`) or a fresh acquire. Its message goes with the first try
    when its key was full a moment ago, else with a second call only if it must wait."""
    checker, lines = ctl.checker, ctl.lines
    with_message = lines.looks_full(call)
    for attempt in (with_message, True):
        entry = turned.entry(attempt)
        if ticket:
            reply = checker.claim(call, ticket, holder=holder, entry=entry, stale_ok=stale_ok)
        else:
            reply = checker.acquire(call, holder=holder, entry=entry, lease=True)
        lines.handle(call, reply)
        if reply.code in (Code.QUEUED, Code.DENIED):
            lines.full(call)
        if reply.code == Code.STALE:
            return reply
        if reply.code != Code.DENIED or attempt:
            return reply
    return reply


def _waited_for_start(ctl: Throttle, call: BoundCall, reply: Any) -> bool:
    """Wait for the start a released task was granted early (``Code.RUN_AT``); False if the process
    woke too late for it: the body would start past its latest start less the slack (the
    wait counts from the script's now, so it never starts before its start). An Event, not
    time.sleep: libfaketime, with which the clock-skew test runs workers, breaks
    time.sleep's clock_nanosleep."""
    replied = time.monotonic()
    threading.Event().wait(reply.wait_us / 1e6)
    # Late is what it overslept. Every start is counted on the script's clock and begins
    # when its reply has come, half a round trip later: a fresh call's too (counted at now,
    # run at once). A granted start shifted as much keeps its distance to every other
    # start, so the reply's trip is not lateness; counted as such, no granted start could
    # be used with a store more than two slacks' round trip away (bench section 13: each
    # one claimed again, one more round trip).
    late_us = int((time.monotonic() - replied) * 1e6) - reply.wait_us
    return reply.start_us + late_us + ctl.checker.slack_us(call.rates) <= reply.latest_us


def _too_long(task: Any, request: Any, call: BoundCall, wait: float, max_wait: float, verb: str,
              what: str) -> WaitTooLong:
    """The error of a task that waits (``verb``) longer than its max_wait for ``what``, its
    signal sent."""
    signals.task_wait_exceeded.send(sender=task, request=request, wait=wait, max_wait=max_wait,
                                    scope=call.scope, key=call.key)
    return WaitTooLong(
        f"task {task.name}[{request.id}] {verb} {_seconds(wait)} for {what} {call.scope!r}"
        f"{'' if call.key is None else f' key {call.key!r}'}: more than its max_wait of {_seconds(max_wait)}"
    )


def _seconds(value: float) -> str:
    """A wait as people read it: 42.5s, 3m 20s, 2h 5m."""
    if value < 60:
        return f"{value:.1f}s"
    minutes, seconds = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes}m {seconds}s"
    return f"{minutes // 60}h {minutes % 60}m"


def _header(request: Any) -> Header:
    """The task's header, its ticket and pending entry kept only if they are its own (a
    header copied onto another task id makes that task a new one, never a copy)."""
    headers = request.headers if isinstance(request.headers, dict) else {}
    return own_header(Header.read(headers.get(HEADER) or getattr(request, HEADER, None)), str(request.id))


def _forget_header(request: Any) -> None:
    """A task that runs is done with its ticket: its own ``self.retry()`` (which copies the
    request's headers) is a new call, checked afresh."""
    _forget_header_of(request.__dict__)


def _forget_header_of(request: dict[str, Any]) -> None:
    request.pop(HEADER, None)
    if isinstance(request.get("headers"), dict):
        request["headers"].pop(HEADER, None)
