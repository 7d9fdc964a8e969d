"""The pool's hook: the decision before Celery's trace starts (:func:`guard`): run now, wait
for a start granted early, or wait in its key's line (:mod:`.deferral` puts it there). The
trace that calls it is in :mod:`.trace`; a body's ``Backoff`` is in :mod:`.backing_off`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from .. import signals
from ..check.controller import controller
from ..check.slots import holder_id
from ..core.cost import too_costly
from ..core.errors import StoreError, ThrottleError, WaitTooLong
from ..core.header import HEADER, Header
from ..core.protocol import Code, Counted, Verdict, WindowReply
from ..core.spec import BoundCall, ThrottleSpec
from ..waits.deferral import TurnedAway, new_entry_id, own_header, redelivered, urgency_of
from . import settle

if TYPE_CHECKING:
    from ..check.limiter import Throttle

__all__ = ["guard"]

logger = logging.getLogger("celery_throttle")

class _Holders(threading.local):
    """The delivery that holds a concurrency slot, by task id, of the bodies this thread
    (or greenlet) runs."""

    running: dict[str, str]

    def __init__(self) -> None:
        self.running = {}


holders = _Holders()


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
    header = header_of(request)
    if call.shadow:
        return _shadow(ctl, task, request, call, header)
    # (A copy sent again after a lost reply makes its calls in a holder of the nonce it
    # names: the store may have started it in that name, and its copy is told apart.)
    holder = holder_id(request.id, header.lost or None)
    turned = TurnedAway(ctl.setup, ctl.lines, task, request, args, kwargs, call, header, max_wait_us=ctl.checker.max_wait_us(spec),
                        holder=holder)
    ticket = header.ticket if header.key == call.state_key else ""
    try:
        reply = _check(ctl, call, turned, holder, ticket, stale_ok=True)
        if reply.verdict is Verdict.STALE:
            # Released under controls this process had not read yet (a resume, a raised
            # limit within CONTROL_REFRESH), which would send it back to its place: read
            # them now and claim again under them (once: then it goes back if it must).
            ctl.checker.refresh_controls()
            call = turned.call = ctl.checker.bind(task, args, kwargs)
            reply = _check(ctl, call, turned, holder, ticket)
        if ticket and reply.verdict is Verdict.COPY and redelivered(request):
            # The broker gave this message back (its worker died, or lost its connection,
            # before acking it): its process may have died waiting for the start granted
            # to its ticket. Never dropped then: checked as a new task (at least once, as
            # Celery's acks_late is).
            turned.entry_id = new_entry_id(request.id)
            ticket = ""
            reply = _check(ctl, call, turned, holder, ticket)
        if reply.verdict is Verdict.START_AT and not _waited_for_start(ctl, call, reply):
            # Woken past what its start allows (a loaded machine): that start is given back,
            # and it is checked again as the task it was released as.
            logger.info("throttled %s[%s] woke too late for the start granted to it; checking again", task.name,
                        request.id)
            reply = ctl.checker.claim(call, ticket or turned.entry_id, holder=holder, granted_us=reply.start_us,
                                      entry=turned.entry(with_message=True))
            ctl.lines.handle(call, reply)
        if ticket and reply.verdict is Verdict.WAITS and ctl.checker.refresh_controls():
            # Released under limits this process had not read yet (one changed within
            # CONTROL_REFRESH: a raised or cleared limit, a resume): it went back to its
            # place under the old ones, so its line is looked at again under the new.
            ctl.lines.wake(call.scope, call.key)
    except StoreError as exc:
        return turned.on_store_error(exc)
    verdict = reply.verdict
    recorder = ctl.recorder
    if recorder.enabled and header.arrives:
        recorder.arrived(task.name, call, request.id, reply.now_us, turned.urgency())
    if ticket and verdict is not Verdict.WAITS and ctl.lines.hand.delivered(request):
        # (Handed to this worker, its journal copy was kept until it came: it has left
        # its line now. One that waits again is back in its place, and keeps it.)
        ctl.lines.journal.gone(call.state_key, [ticket], reply.now_us)
    pending = header.pending if header.key == call.state_key else ""
    if pending and pending != ticket and (verdict is Verdict.START or verdict is Verdict.START_AT):
        # (A copy sent back after a store error, naming the entry its call may have left it
        # in, or that held it before: it starts now. That entry's journal copy, should the
        # store have lost the entry, would send it on again after a loss.)
        ctl.lines.journal.gone(call.state_key, [pending], reply.now_us)
    if verdict is Verdict.START or verdict is Verdict.START_AT:
        _forget_header(request)
        ctl.metrics.admitted(call.scope, call.key)
        if recorder.enabled:
            recorder.started(request.id, reply.start_us or reply.now_us)
        settle.started(request.id, call, ctl.checker.counted(call, reply))
        if reply.held:
            holders.running[request.id] = holder
            ctl.slots.took(holder, call)
        return True
    if verdict is Verdict.WAITS:
        turned.waits_in_pool(reply)
        return False
    if verdict is Verdict.COPY:
        # A copy of a task that started lately (sent again after a store error whose reply
        # was lost, or delivered twice): it does not run twice.
        return _dropped_copy(ctl, task, request, call)
    if verdict is Verdict.REFUSED:
        raise _refused(task, request, call, reply, turned.max_wait_us / 1e6)
    # (NOT_KEPT with its message given: nothing could keep it. Sent back for a moment.)
    logger.warning("throttled %s[%s] could not join its line; sent back for a second", task.name, request.id)
    turned.send_back(1.0)
    return False


def _shadow(ctl: Throttle, task: Any, request: Any, call: BoundCall, header: Header) -> bool:
    """Shadow mode: where enforcing would have started the call is counted and reported
    (:meth:`.Checker.shadow`), and its body runs now, whatever the answer (a store error
    too: shadow mode holds nothing)."""
    holder = holder_id(request.id, None)
    spec: ThrottleSpec = type(task)._throttle_spec
    mine = header.key == call.state_key
    try:
        if mine and header.ticket:
            # Released from its line before its throttle went to shadow mode: the room it
            # was released into goes back, and it counts as started (a copy of its message,
            # sent twice, is dropped as after any start).
            given = ctl.checker.give_back(call, header.ticket, shadowed=True)
            ctl.lines.handle(call, given)
            if given.code == Code.DUPLICATE:
                return _dropped_copy(ctl, task, request, call)
            if ctl.lines.hand.delivered(request):
                ctl.lines.journal.gone(call.state_key, [header.ticket], given.now_us)
        elif mine and header.pending:
            # A call whose reply was lost may have put it in its line: it runs now, so that
            # entry goes (it would run again when the line lets it go).
            dropped = ctl.checker.drop(call, [header.pending])
            ctl.lines.handle(call, dropped)
            ctl.lines.journal.gone(call.state_key, [header.pending], dropped.now_us)
        shadowed, reply = ctl.checker.shadow(call, holder if call.concurrency else "", ctl.checker.max_wait_us(spec))
    except StoreError as exc:
        ctl.metrics.store_error("shadow")
        logger.warning("throttle store unreachable for %s[%s] in shadow mode, run unchecked: %s", task.name,
                       request.id, exc)
        return True
    _forget_header(request)
    if ctl.recorder.enabled:
        if header.arrives:
            ctl.recorder.arrived(task.name, call, request.id, reply.now_us, urgency_of(ctl.app, call, request))
        ctl.recorder.started(request.id, reply.now_us)
    held = reply.code != Code.RUN
    wait = max(reply.wait_us, 0) / 1e6
    ctl.metrics.shadowed(call.scope, call.key, wait if held else None)
    if held:
        if reply.code == Code.TOO_COSTLY:
            reason = "cost"
        elif reply.code == Code.TOO_FAR:
            reason = "max_wait"
        elif reply.wait_us > 0:
            reason = "pause" if ctl.checker.pause_end_of(call.scope, call.key) >= reply.start_us else "rate"
        else:
            reason = "concurrency"
        signals.task_shadow_throttled.send(sender=task, request=request, delay=wait, scope=call.scope, key=call.key,
                                           reason=reason)
    recorded = call.rates and reply.start_us and reply.code in (Code.RUN, Code.DENIED)  # (else nothing recorded)
    counted = Counted(reply.start_us, reply.latest_us, call.cost, reply.epoch) if recorded else None
    settle.started(request.id, shadowed, counted)
    if reply.held:
        holders.running[request.id] = holder
        ctl.slots.took(holder, shadowed)
    return True


def _dropped_copy(ctl: Throttle, task: Any, request: Any, call: BoundCall) -> bool:
    """A copy of a task that started lately is dropped, said and counted: False (no body)."""
    logger.warning("%s[%s] is a copy of a task that started lately in scope %r%s: dropped, not run twice",
                   task.name, request.id, call.scope, "" if call.key is None else f" key {call.key!r}")
    ctl.metrics.store_error("duplicate")
    return False



def _check(ctl: Throttle, call: BoundCall, turned: TurnedAway, holder: str, ticket: str,
           stale_ok: bool = False) -> WindowReply:
    """The call's check (:meth:`.Lines.tries`): its claim (a released task, with its
    ``ticket``; ``stale_ok``: see :meth:`.Checker.claim`) or a fresh acquire."""
    checker, lines = ctl.checker, ctl.lines
    for with_message in lines.tries(call):
        entry = turned.entry(with_message)
        if ticket:
            reply = checker.claim(call, ticket, holder=holder, entry=entry, stale_ok=stale_ok)
        else:
            reply = checker.acquire(call, holder=holder, entry=entry, lease=True)
        if lines.checked(call, reply):
            break
    return reply


def _waited_for_start(ctl: Throttle, call: BoundCall, reply: Any) -> bool:
    """Wait for the start a released task was granted early (``Verdict.START_AT``); False if the process
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


def _refused(task: Any, request: Any, call: BoundCall, reply: WindowReply, max_wait: float) -> ThrottleError:
    """The error of a task refused (:attr:`.Verdict.REFUSED`): one that would wait, or
    waited, longer than its max_wait (its signal sent and counted:
    ``celery_throttle_wait_exceeded_total``), or whose cost never fits its rates."""
    if reply.code == Code.TOO_COSTLY:
        return too_costly(call.scope, call.rates, call.cost)
    verb, what = ("would wait", "scope") if reply.code == Code.TOO_FAR else ("waited", "its turn in the line of scope")
    wait = (reply.wait_us if reply.code == Code.TOO_FAR else reply.waited_us) / 1e6
    controller(task.app).metrics.wait_exceeded(call.scope, call.key)
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


def header_of(request: Any) -> Header:
    """The task's header, its ticket and pending entry kept only if they are its own (a
    header copied onto another task id makes that task a new one, never a copy)."""
    headers = request.headers if isinstance(request.headers, dict) else {}
    return own_header(Header.read(headers.get(HEADER) or getattr(request, HEADER, None)), str(request.id))


def _forget_header(request: Any) -> None:
    """A task that runs is done with its ticket: its own ``self.retry()`` (which copies the
    request's headers) is a new call, checked afresh."""
    forget_header_of(request.__dict__)


def forget_header_of(request: dict[str, Any]) -> None:
    request.pop(HEADER, None)
    if isinstance(request.get("headers"), dict):
        request["headers"].pop(HEADER, None)
