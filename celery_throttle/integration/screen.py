"""Consumer-side screening: put fresh messages that cannot start in their line before
they reach the pool.

A denial in the pool costs a whole task execution (and Celery's ``Ignore`` handling,
several ms of CPU): in a burst of 10x the limit, the pool would spend seconds turning
tasks away while released ones wait behind them. So a fresh message of a throttled task
(no ETA, no ticket) is checked here first, in the consumer, with one script call that
records nothing if the task fits now; one that cannot start joins its key's line (its
message kept in the store) and is acked, without ever reaching the pool. Whatever fits,
or cannot be screened (bad arguments, Redis down), goes to the pool as usual, where
``before_start`` makes the real, authoritative check. A key that keeps fitting is only
sampled (one message in eight), so tasks under their limit do not pay twice. A store far
away (SCREEN_RTT_MAX_US) is not screened against at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery import bootsteps
from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu.exceptions import ContentDisallowed, DecodeError

from ..celery_parts.internals import no_process_free, request_context_factory
from ..check.breaker import Breaker
from ..check.controller import controller
from ..core.errors import StoreError, ThrottleError
from ..core.header import HEADER, Header
from ..core.protocol import Verdict
from ..core.timing import SCREEN_RTT_MAX_US, STORE_ERROR_PAUSE
from ..waits.deferral import TurnedAway, own_header

__all__ = ["ScreenStep", "screen_strategies"]

logger = logging.getLogger("celery_throttle")


class ScreenStep(bootsteps.StartStopStep):
    """Wraps the consumer's strategy of each throttled task (after they are built)."""

    label = "celery_throttle screen"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        screen_strategies(controller(c.app), c)


def screen_strategies(ctl: Any, c: Any) -> None:
    """Wrap the strategy of each hooked task of consumer ``c`` (again after a reload,
    which builds them anew)."""
    if not ctl.settings.enabled:
        return
    breaker = c.__dict__.setdefault("_throttle_breaker", Breaker(STORE_ERROR_PAUSE))
    for name, task in c.app.tasks.items():
        if (type(task).__dict__.get("_throttle_hooked") and name in c.strategies
                and not getattr(c.strategies[name], "_throttle_screened", False)):
            # (Once: at consumer start, update_strategies builds them and screens them,
            # then this step runs; wrapped twice, a message would be screened twice.)
            c.strategies[name] = _screened(ctl, task, c.strategies[name], c.connection_errors, breaker,
                                           lambda: no_process_free(c))




#: After this many screened messages of a task in a row fit, only one in this many is
#: screened until the next denial (one in four times as many after a long run of fits):
#: under its limit a task then pays one round trip, not two, and the onset of a burst is
#: still seen within a few dozen messages (the pool turns away those in between). The
#: count is per task, not per key: a skipped message is not even decoded.
_SAMPLE = 8


def _screened(ctl: Any, task: Any, handler: Callable[..., Any], errors: Any,
              breaker: Breaker, busy: Callable[[], bool] = lambda: False) -> Callable[..., Any]:
    request_context = request_context_factory(task)
    fits_in_a_row = 0

    def screened(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any) -> Any:
        nonlocal fits_in_a_row
        headers = message.headers or {}
        if ("task" in headers and not breaker.open and ctl.lines.hand.delivered(message)
                and busy() and _hand_back(ctl, task, message)):
            ack(logger, errors)
            return None
        if ("task" not in headers or headers.get("eta") or breaker.open or _expired(headers)
                or ctl.store.rtt_us >= SCREEN_RTT_MAX_US or Header.read(headers.get(HEADER)).ticket):
            return handler(message, body, ack, reject, callbacks, **kw)
        streak = fits_in_a_row
        every = _SAMPLE if streak < 8 * _SAMPLE else 4 * _SAMPLE
        if streak >= _SAMPLE and streak % every:
            fits_in_a_row = streak + 1
            return handler(message, body, ack, reject, callbacks, **kw)
        turned = None
        try:
            args, kwargs = _arguments(message)
            spec = type(task)._throttle_spec
            call = ctl.checker.bind(task, args, kwargs, quick=True)
            if call.shadow:  # (checked in the pool, which holds nothing of it)
                return handler(message, body, ack, reject, callbacks, **kw)
            turned = TurnedAway(ctl.setup, ctl.lines, task, request_context(message), args, kwargs, call,
                                own_header(Header.read(headers.get(HEADER)), str(headers.get("id"))),
                                max_wait_us=ctl.checker.max_wait_us(spec))
            for with_message in ctl.lines.tries(call):
                reply = ctl.checker.screen(call, turned.entry(with_message))
                if ctl.lines.checked(call, reply):
                    break
        except StoreError as exc:
            # Redis down or slow: stop screening for a while; the pool's check decides. It
            # names the entry the failed call may have left it in its line (its reply lost),
            # so that the pool's check does not let it in twice.
            ctl.metrics.store_error("consumer")
            breaker.trip()
            logger.warning("throttle store unreachable from the consumer, not screening for %.0fs: %s",
                           STORE_ERROR_PAUSE, exc)
            if turned is not None:
                _name_entry(message, turned)
            return handler(message, body, ack, reject, callbacks, **kw)
        except ThrottleError:
            # Bad arguments: the pool path deals with it, visibly.
            return handler(message, body, ack, reject, callbacks, **kw)
        except (DecodeError, ContentDisallowed, ValueError, TypeError):
            # A body that does not decode: Celery's own path reports it.
            return handler(message, body, ack, reject, callbacks, **kw)
        except Exception:
            logger.exception("could not screen %s[%s]; handing it to the pool", task.name, headers.get("id"))
            return handler(message, body, ack, reject, callbacks, **kw)
        verdict = reply.verdict
        if verdict is Verdict.COPY:
            logger.warning("%s[%s] is a copy of a task that started lately: dropped, not run twice", task.name,
                           headers.get("id"))
            ctl.metrics.store_error("duplicate")
            ack(logger, errors)
            return None
        if verdict is not Verdict.WAITS:
            # (It fits, or could not be kept, or is refused: the pool's check decides.)
            if verdict is Verdict.START:
                fits_in_a_row = streak + 1
            return handler(message, body, ack, reject, callbacks, **kw)
        fits_in_a_row = 0
        if ctl.recorder.enabled and turned.header.arrives:  # (it comes to the pool with a ticket: not again)
            ctl.recorder.arrived(task.name, turned.call, turned.request.id, reply.now_us, turned.urgency())
        if not turned.waits(reply):
            # (The journal refused its copy: its message is not acked, but goes to the
            # pool naming its entry, where it is told it waits and sent back to the broker.)
            _name_entry(message, turned)
            return handler(message, body, ack, reject, callbacks, **kw)
        ack(logger, errors)
        return None

    screened._throttle_screened = True  # type: ignore[attr-defined]
    return screened


def _name_entry(message: Any, turned: TurnedAway) -> None:
    """Its header names the entry a call may have left it in its line (``pending``), so that
    the pool's check does not let it in twice."""
    if turned.entry_id and isinstance(message.headers, dict):
        h = turned.header
        message.headers[HEADER] = Header(turned.call.state_key, h.ticket, h.deferrals, h.errors, turned.entry_id,
                                         h.lost).value()


def _expired(headers: dict[str, Any]) -> bool:
    """Whether a message's ``expires`` has passed: Celery discards it (its own revoked
    signal says so); screened, it would join its line again, and be said throttled again
    each time the line sends it on as expired."""
    raw = headers.get("expires")
    if not raw:
        return False
    try:
        when = maybe_make_aware(maybe_iso8601(raw))
    except (TypeError, ValueError, OverflowError):
        return False  # (a value Celery cannot read either: its own path reports it)
    return bool(when <= datetime.now(timezone.utc))


def _hand_back(ctl: Any, task: Any, message: Any) -> bool:
    """A task handed to this worker (:mod:`..celery_parts.hand`) that would wait here for a
    process (its worker took more than it has: a task sent to the common queue before it
    came) goes back to its place and is released again to the common queue, where a worker
    with a free process takes it. True: done (its message is acked); False: it stays here."""
    header = Header.read((message.headers or {}).get(HEADER))
    try:
        args, kwargs = _arguments(message)
        call = ctl.checker.bind(task, args, kwargs, quick=True)
        if not header.ticket or header.key != call.state_key:
            return False
        reply = ctl.checker.give_back(call, header.ticket, handed_back=True)
    except Exception as exc:  # noqa: BLE001 - it starts here, later: the pool's check decides
        logger.debug("could not hand %s[%s] back to its line: %r", task.name, (message.headers or {}).get("id"), exc)
        return False
    ctl.lines.handle(call, reply)
    # Only when its entry was put back and sent on again is this copy done with. A ticket
    # the store does not hold out (forged, or one released again since) goes to the pool,
    # which checks it (a fresh call, or a copy dropped with a warning); one put back but
    # not sent on again is claimed there from its place.
    return any(t.id == header.ticket and t.kind == "r" for t in reply.reported)


def _arguments(message: Any) -> tuple[Any, Any]:
    """(args, kwargs) of a protocol 2 message: its body is ``[args, kwargs, embed]``.
    (Celery defers decoding to the pool; one decode here is cheaper than a Request.)"""
    args, kwargs, _ = message.decode()
    return args, kwargs
