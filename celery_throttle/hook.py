"""The task side: decides before Celery's trace starts; a denied task is turned away
(:mod:`.deferral` sends it back).

Every execution in a worker, in any pool, goes through the task's ``__trace__`` (the
tracer Celery builds per task, in the consumer and again in each pool child). A hooked
task's class turns that attribute into a property that wraps each tracer it is given:
the wrapper checks the window first, and a denied task is deferred and handed back to
the pool as Celery's own ``Ignore`` would be (acked, nothing stored, nothing logged)
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
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore

from . import settle, signals
from .backoff import Backoff
from .controller import controller
from .deferral import TurnedAway
from .errors import StoreError, WaitTooLong
from .internals import build_task_tracer, deferred_trace_result, has_own, trace_context
from .protocol import HEADER, Code, Reservation, SlotCode, read_state
from .spec import BoundCall, ThrottleSpec, declared_spec
from .timing import wait_here_us

if TYPE_CHECKING:
    from .limiter import Throttle

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
    """Pause the task's scope (and key) for every worker, and send the task back to run
    after the pause, its retries untouched. Raises Ignore (or ``exc`` for a call that is
    not a task execution: eager, direct)."""
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
    if guard(task, args, kwargs):
        # Not deferred by the check (throttling switched off, or the pause could not be
        # written): sent back for the pause all the same.
        TurnedAway(ctl, task, request, args, kwargs, call, {}).send_back(exc.seconds, None, may_park=False)
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
    try:
        slots = controller(task.app).slots
        if slots.holds(task_id):
            slots.release(task_id)
    except Exception as exc:  # noqa: BLE001 - its lease runs out, and the slot is reclaimed
        logger.warning("could not give back the concurrency slot of %s[%s]: %r; it is reclaimed when its lease "
                       "runs out", task.name, task_id, exc)


def _signature(task: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(task.run)
    except (TypeError, ValueError):
        return None


def guard(task: Any, args: Any, kwargs: Any) -> bool:
    """True: run the body now. False: the task was deferred (re-sent or parked)."""
    request = task.request
    if request.is_eager or request.called_directly:
        return True  # direct and eager calls are not task executions: never throttled
    ctl = controller(task.app)
    if not ctl.settings.enabled:
        if _header(request).get("w"):
            _take_handed_slot(ctl, task, args, kwargs, request.id)
        return True
    spec: ThrottleSpec = type(task)._throttle_spec
    call = ctl.checker.bind(task, args, kwargs)
    state = _header(request)
    if not call.concurrency and not state.get("w"):
        # (A task that waited for a slot takes the one it was handed even where no K is
        # in force any more, a live K cleared: its kept message is deleted with it.)
        return _check_rates(ctl, task, request, args, kwargs, spec, call, state)
    # A slot first: a task denied one consumes no rate; one its rates deny gives its
    # slot back at once (to the next task waiting for it).
    now_us = _take_slot(ctl, task, request, args, kwargs, spec, call, state)
    if now_us is None:
        return False
    if not call.rates:
        # (No window to say whether a pause holds it: this process's copy of the pauses.)
        if now_us and ctl.checker.holds(call, now_us):
            ctl.slots.release(request.id)
            TurnedAway(ctl, task, request, args, kwargs, call, state).hold_for_pause(now_us)
            return False
        _forget_header(request)
        ctl.metrics.admitted(call.scope, call.key)
        return True
    runs = False
    try:
        runs = _check_rates(ctl, task, request, args, kwargs, spec, call, state)
    finally:
        if not runs:
            ctl.slots.release(request.id)
    return runs


def _take_handed_slot(ctl: Throttle, task: Any, args: Any, kwargs: Any, task_id: str) -> None:
    """Throttling is off, and this task waited for a concurrency slot: it takes the one it
    was handed (given back when its body ends), so that its kept message is deleted and
    not woken again when that slot's lease runs out. Never raises: the task runs."""
    try:
        ctl.slots.take(replace(ctl.checker.bind(task, args, kwargs), concurrency=0), task_id)
    except Exception as exc:  # noqa: BLE001 - logged; at worst the task is woken again
        logger.warning("could not take the concurrency slot %s[%s] was handed (throttling is off): %r",
                       task.name, task_id, exc)


def _take_slot(ctl: Throttle, task: Any, request: Any, args: Any, kwargs: Any, spec: ThrottleSpec,
               call: BoundCall, state: dict[str, Any]) -> int | None:
    """Take a concurrency slot for the task (the Redis clock's now, µs; 0 when the store
    could not be reached and the policy runs it), or leave it waiting for one, its
    message kept with its key's queue (None)."""
    slots = ctl.slots
    turned = TurnedAway(ctl, task, request, args, kwargs, call, state)
    try:
        reply = slots.take(call, request.id, turned.slot_message() if slots.looks_full(call) else b"")
        if reply.code == SlotCode.FULL:
            reply = slots.take(call, request.id, turned.slot_message())
    except StoreError as exc:
        return 0 if turned.on_store_error(exc) else None
    if reply.code == SlotCode.QUEUED:
        turned.waits_for_slot(reply.running, reply.waiting)
        return None
    max_wait = ctl.checker.max_wait(spec)
    waited = time.time() - int(state["w"]) / 1e6 if state.get("w") else 0.0
    if max_wait and waited > max_wait:
        slots.release(request.id)
        raise _too_long(task, request, call, waited, max_wait, "waited", "a concurrency slot of scope")
    # Its wait for a slot is over: if its rates send it back, the wait that follows is
    # theirs, held to max_wait by the reservation.
    state.pop("w", None)
    return reply.now_us


def _check_rates(ctl: Throttle, task: Any, request: Any, args: Any, kwargs: Any, spec: ThrottleSpec,
                 call: BoundCall, state: dict[str, Any]) -> bool:
    """The rates' check of a call: True, run now; False, deferred to its reserved start."""
    ident = call.state_key
    claim = Reservation.from_header(state.get("r")) if state.get("k") == ident else None
    max_wait = ctl.checker.max_wait(spec)
    resumed = False
    if state.get("p"):
        # A pause held it: is the pause over (resumed: nothing waits for its end)?
        ctl.checker.refresh_controls()
        resumed = claim is not None and not ctl.checker.pause_end_us(call)
    try:
        # (Sent back a little early on purpose, dispatch takes a while: a claim that comes
        # at most that early is granted its start, and waits for it here, rather than a
        # round trip through the broker or a second call.)
        reply = ctl.checker.check(call, reserve=True, claim=claim, claimant=request.id, lease=True, max_wait=max_wait,
                                  resumed=resumed, early_us=_wait_here_us(ctl, call, claim) if claim else 0)
        if reply.code == Code.RUN_AT and not _waited_for_start(ctl, call, reply):
            # Woken past what its start allows (a loaded machine): that start is used up
            # (its units still count, a window at most), and the call is checked afresh.
            logger.info("throttled %s[%s] woke too late for the start granted to it; checking again", task.name,
                        request.id)
            claim = None
            reply = ctl.checker.check(call, reserve=True, max_wait=max_wait)
    except StoreError as exc:
        return TurnedAway(ctl, task, request, args, kwargs, call, state).on_store_error(exc)
    if reply.allowed or reply.code == Code.RUN_AT:
        _forget_header(request)
        ctl.metrics.admitted(call.scope, call.key)
        settle.started(request.id, call, ctl.checker.counted(call, reply, claim))
        return True
    if reply.code == Code.TOO_FAR:
        raise _too_long(task, request, call, reply.wait_us / 1e6, max_wait or 0, "would wait", "scope")
    if claim is not None and reply.code in (Code.DENIED, Code.RESERVED):
        # Its reserved start could not be used (it came too late, or the window state it
        # was made in is gone): it queues again behind every start reserved since.
        logger.info("throttled %s[%s] could not use its reserved start (now %+.1f ms from it); "
                    "reserving again", task.name, request.id, (reply.now_us - claim.start_us) / 1000)
    TurnedAway(ctl, task, request, args, kwargs, call, state).defer(reply, claim)
    return False


def _waited_for_start(ctl: Throttle, call: BoundCall, reply: Any) -> bool:
    """Wait for the start a claim was granted early (``Code.RUN_AT``); False if the process
    woke too late for it: the body would start past its latest start less the slack (the
    wait counts from the script's now, so it never starts before its start). An Event, not
    time.sleep: libfaketime, with which the clock-skew test runs workers, breaks
    time.sleep's clock_nanosleep."""
    replied = time.monotonic()
    threading.Event().wait(reply.wait_us / 1e6)
    overslept_us = int((time.monotonic() - replied) * 1e6) - reply.wait_us
    # (The reply took half a round trip to come: the start began that much before it.)
    late_us = overslept_us + ctl.store.rtt_us // 2
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


def _wait_here_us(ctl: Throttle, call: BoundCall, claim: Reservation) -> int:
    """How early an arrival may be and still wait in the worker instead of going back."""
    return wait_here_us(claim.lead_us, ctl.checker.slack_us(call.rates))


def _header(request: Any) -> dict[str, Any]:
    headers = request.headers if isinstance(request.headers, dict) else {}
    return read_state(headers.get(HEADER) or getattr(request, HEADER, None))


def _forget_header(request: Any) -> None:
    """A task that runs is done with its reservation: its own ``self.retry()`` (which
    copies the request's headers) is a new call, checked afresh, not a late claim."""
    _forget_header_of(request.__dict__)


def _forget_header_of(request: dict[str, Any]) -> None:
    request.pop(HEADER, None)
    if isinstance(request.get("headers"), dict):
        request["headers"].pop(HEADER, None)
