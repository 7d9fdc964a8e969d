"""``throttle why TASK_ID``: where one task waits, until when, and what holds it.

The store answers for a parked task (waiting for its time, being released, or a dead
letter; or, noted in its index, parked in the broker). The workers answer, through Celery's remote control (the ``throttle_why``
command registered here, in every process that imports the plugin), for a task they
hold: as a countdown in the worker's timer (a task sent back, or sent at publish, to
arrive for its reserved start), received and waiting for a pool process, or running. A
task found in neither waits in a queue no worker has taken it from, or is done.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.worker.control import inspect_command
from celery.worker.request import Request
from kombu.exceptions import ContentDisallowed, DecodeError

from .internals import held_requests
from .keys import PARKED_TAG_END, state_of
from .messages import decode_message
from .protocol import HEADER, Reservation, read_state

if TYPE_CHECKING:
    from .limiter import RateStatus, Throttle

__all__ = ["Whereabouts", "explain", "parked_call"]

#: Seconds ``throttle why`` waits for the workers' answers.
REPLY_TIMEOUT = 1.0


@dataclass
class Whereabouts:
    """Where a task waits (``where``), and what is known of why."""

    task_id: str
    #: ``parked`` | ``releasing`` | ``dead`` (the store), ``slot`` (waiting for a
    #: concurrency slot, in the store), ``delayed`` | ``held`` (parked in the broker),
    #: ``countdown`` | ``received`` | ``running`` (a worker), or ``unknown``.
    where: str
    name: str | None = None
    scope: str | None = None
    key: str | None = None
    #: Unix time: due (parked), the countdown's end, or when it became a dead letter.
    until: float | None = None
    #: The start its reservation holds (Unix time), if it carries one.
    start: float | None = None
    #: The worker that holds it.
    worker: str | None = None
    #: Whether a pause holds it (it was parked for a resume to send).
    held_by_pause: bool = False
    #: When a pause of its scope or key ends (``inf``: until resumed), if one is set.
    paused_until: float | None = None
    #: The fullest rate of its scope and key now.
    fullest: RateStatus | None = None
    #: Workers that answered (for a task no store or worker holds).
    workers_asked: int = 0
    #: Waiting for a concurrency slot (``where`` is ``slot``): its place in the key's
    #: queue (1: next), the tasks waiting, the slots held and the limit.
    place: int | None = None
    waiting: int | None = None
    running: int | None = None
    concurrency: int | None = None


def parked_call(ctl: Throttle, message: bytes | None) -> tuple[str, dict[str, Any]]:
    """(task name, its ``celery_throttle`` header as read) of a parked message."""
    try:
        body = decode_message(ctl.app, message or b"")
    except (ValueError, TypeError, AttributeError, DecodeError, ContentDisallowed):
        return "<cannot be decoded>", {}
    return body["task"], read_state((body["options"].get("headers") or {}).get(HEADER))


def explain(ctl: Throttle, task_id: str, timeout: float = REPLY_TIMEOUT) -> Whereabouts:
    """Where task ``task_id`` waits, asking the store, then the workers."""
    found = ctl.parking.find_parked(task_id)
    if found:
        where, parked_id, when_us, message = min(found, key=lambda f: ("waiting", "releasing", "dead").index(f[0]))
        name, state = parked_call(ctl, message)
        out = Whereabouts(task_id, "parked" if where == "waiting" else where, name, until=when_us / 1e6,
                          held_by_pause=PARKED_TAG_END in parked_id)
        if message is None:
            out.name = "<message gone>"
    elif (queued := ctl.slots.store.find(task_id)) is not None:
        state_key, place, message = queued
        name, state = parked_call(ctl, message)
        out = Whereabouts(task_id, "slot", name, place=place)
        named = state_of(ctl.settings.key_prefix, state_key)
        if named is not None:
            out.scope, out.key = named
            status = ctl.status(*named)
            out.running, out.waiting, out.concurrency = status.running, status.waiting, status.concurrency
        return out
    elif (noted := ctl.parking.find_in_broker(task_id)) is not None:
        due_us, info = noted
        entry = json.loads(info)
        state = read_state(entry.get("h"))
        in_held_queue = bool(entry.get("held"))
        out = Whereabouts(task_id, "held" if in_held_queue else "delayed", entry.get("t"),
                          until=None if in_held_queue else due_us / 1e6, held_by_pause=in_held_queue)
    else:
        replies = ctl.app.control.broadcast("throttle_why", arguments={"task_id": task_id}, reply=True,
                                            timeout=timeout)
        answers = [(worker, answer) for reply in replies or () for worker, answer in reply.items()]
        holder = next(((w, a) for w, a in answers if isinstance(a, dict) and a.get("where")), None)
        if holder is None:
            return Whereabouts(task_id, "unknown", workers_asked=len(answers))
        worker, answer = holder
        state = read_state(answer.get("header"))
        eta = answer.get("eta")
        out = Whereabouts(task_id, str(answer["where"]), answer.get("name"), worker=worker,
                          until=dt.datetime.fromisoformat(eta).timestamp() if isinstance(eta, str) else None,
                          held_by_pause=bool(state.get("p")), workers_asked=len(answers))
    reservation = Reservation.from_header(state.get("r"))
    if reservation is not None:
        out.start = reservation.start_us / 1e6
    named = state_of(ctl.settings.key_prefix, state["k"]) if "k" in state else None
    if named is not None:
        out.scope, out.key = named
        status = ctl.status(*named)
        out.paused_until = status.paused_until
        out.fullest = min(status.rates, key=lambda r: (r.remaining, -r.reset_at), default=None)
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
    header = held.get(HEADER) or (held.get("headers") or {}).get(HEADER)
    eta = request.eta
    return {"where": where, "name": request.name, "header": read_state(header),
            "eta": eta.isoformat() if isinstance(eta, dt.datetime) else None}
