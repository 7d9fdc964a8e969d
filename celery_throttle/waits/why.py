"""``throttle why TASK_ID``: where one task waits, until when, and what holds it.

The store answers for a task in a key's line (its place, and an estimate of its start),
one released from it and on its way, and a dead letter. The workers answer, through Celery's remote control (the ``throttle_why`` command
registered here, in every process that imports the plugin), for a task they hold: as a
countdown in the worker's timer, received and waiting for a pool process, or running. A
task found in neither waits in a queue no worker has taken it from, or is done. No answer
carries a ticket (what would let a client forge a released task's header).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.worker.control import inspect_command
from celery.worker.request import Request
from kombu.exceptions import ContentDisallowed, DecodeError

from ..celery_parts.internals import held_requests
from ..celery_parts.messages import decode_message
from ..core.header import HEADER, Header
from ..core.keys import encode, glob_escape, state_of

if TYPE_CHECKING:
    from ..check.limiter import Throttle
    from ..check.status import RateStatus

__all__ = ["Whereabouts", "explain", "parked_call"]

#: Seconds ``throttle why`` waits for the workers' answers.
REPLY_TIMEOUT = 1.0


@dataclass
class Whereabouts:
    """Where a task waits (``where``), and what is known of why."""

    task_id: str
    #: ``line`` (waiting in its key's line), ``released`` (released from it, on its way to
    #: a worker), ``dead`` (a dead letter), ``countdown`` | ``received`` | ``running`` (a
    #: worker), or ``unknown``.
    where: str
    name: str | None = None
    scope: str | None = None
    key: str | None = None
    #: Unix time: the countdown's end, or when it became a dead letter.
    until: float | None = None
    #: An estimate of its start (Unix time), waiting in a line.
    start: float | None = None
    #: The worker that holds it.
    worker: str | None = None
    #: When a pause of its scope or key ends (``inf``: until resumed), if one is set.
    paused_until: float | None = None
    #: The fullest rate of its scope and key now.
    fullest: RateStatus | None = None
    #: An adaptive throttle's level now, or None.
    adaptive: Any = None
    #: Workers that answered (for a task no store or worker holds).
    workers_asked: int = 0
    #: Waiting in a line: its place (1: next), the tasks waiting, the slots held and the
    #: concurrency limit.
    place: int | None = None
    waiting: int | None = None
    running: int | None = None
    concurrency: int | None = None
    #: Its key's cap in its scope's share of slots, or None.
    share_cap: int | None = None


def parked_call(ctl: Throttle, message: bytes | None) -> tuple[str, Header]:
    """(task name, its ``celery_throttle`` header as read) of a kept message."""
    try:
        body = decode_message(ctl.app, message or b"")
    except (ValueError, TypeError, AttributeError, DecodeError, ContentDisallowed):
        return "<cannot be decoded>", Header()
    return body["task"], Header.read((body["options"].get("headers") or {}).get(HEADER))


def find_in_lines(ctl: Throttle, task_id: str) -> tuple[str, str, int, bytes | None] | None:
    """(``line`` | ``released``, state key, place in the line from 1 (0: released), its
    message) of task ``task_id``, among the keys with a line (the index)."""
    return ctl.store.find_entry(glob_escape(encode(task_id)) + ":*")


def find_dead_letter(ctl: Throttle, task_id: str) -> tuple[int, bytes | None] | None:
    """(since when in µs, its message) of task ``task_id`` kept as a dead letter (its id is
    its line entry's: the encoded task id, then ``:``)."""
    found = ctl.store.find_dead(glob_escape(encode(task_id)) + ":*")
    return (found[0][1], found[0][2]) if found else None


def explain(ctl: Throttle, task_id: str, timeout: float = REPLY_TIMEOUT) -> Whereabouts:
    """Where task ``task_id`` waits, asking the store, then the workers."""
    key: str | None = None
    if (lined := find_in_lines(ctl, task_id)) is not None:
        where, key, place, message = lined
        name, _ = parked_call(ctl, message)
        out = Whereabouts(task_id, where, name, place=place or None)
    elif (letter := find_dead_letter(ctl, task_id)) is not None:
        since_us, message = letter
        name, header = parked_call(ctl, message)
        key = header.key or None
        out = Whereabouts(task_id, "dead", name if message is not None else "<message gone>", until=since_us / 1e6)
    else:
        replies = ctl.app.control.broadcast("throttle_why", arguments={"task_id": task_id}, reply=True,
                                            timeout=timeout)
        answers = [(worker, answer) for reply in replies or () for worker, answer in reply.items()]
        holder = next(((w, a) for w, a in answers if isinstance(a, dict) and a.get("where")), None)
        if holder is None:
            return Whereabouts(task_id, "unknown", workers_asked=len(answers))
        worker, answer = holder
        eta = answer.get("eta")
        key = answer.get("key") if isinstance(answer.get("key"), str) else None
        out = Whereabouts(task_id, str(answer["where"]), answer.get("name"), worker=worker,
                          until=dt.datetime.fromisoformat(eta).timestamp() if isinstance(eta, str) else None,
                          workers_asked=len(answers))
    named = state_of(ctl.settings.key_prefix, key) if key else None
    if named is not None:
        out.scope, out.key = named
        status = ctl.status(*named)
        out.paused_until = status.paused_until
        out.fullest = min(status.rates, key=lambda r: (r.remaining, -r.reset_at), default=None)
        out.adaptive = status.adaptive
        out.running, out.waiting, out.concurrency = status.running, status.waiting, status.concurrency
        out.share_cap = status.share_cap
        if out.where == "line" and out.place is not None:
            out.start = status.estimate(out.place)
    return out


@inspect_command(args=[("task_id", str)], signature="<task_id>")
def throttle_why(state: Any, task_id: str, **kwargs: Any) -> dict[str, Any]:
    """Where this worker holds task ``task_id``: a countdown in its timer, received and
    waiting for a pool process, or running (``{}``: it does not hold it)."""
    for where, request in held_requests(state.consumer):
        if request.id == task_id:
            return _answer(where, request)
    return {}


def _answer(where: str, request: Request) -> dict[str, Any]:
    held = request.request_dict
    header = Header.read(held.get(HEADER) or (held.get("headers") or {}).get(HEADER))
    eta = request.eta
    # (Its key, and never its ticket: any client of the broker may ask.)
    return {"where": where, "name": request.name, "key": header.key or None,
            "eta": eta.isoformat() if isinstance(eta, dt.datetime) else None}
