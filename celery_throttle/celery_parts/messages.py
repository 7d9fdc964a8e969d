"""Kept messages: a task's message as the store keeps it (waiting in a line, a dead
letter), and how it is sent to the broker again."""

from __future__ import annotations

from typing import Any

from kombu.serialization import dumps, loads, prepare_accept_content

from ..core.header import HEADER, Header
from ..core.priority import urgency

__all__ = ["KEPT_FIELDS", "decode_message", "encode_message", "message_urgency", "resend", "task_of"]

#: What a kept message holds: encode_message writes these, and decode_message reads no other.
KEPT_FIELDS = ("task", "args", "kwargs", "options")
#: A send's options that choose where it goes (dropped from one sent to a given queue).
_ROUTING = ("queue", "exchange", "routing_key", "exchange_type")


def encode_message(app: Any, sig: Any) -> bytes:
    """Serialize a signature with the app's task serializer."""
    options = {k: v for k, v in sig.options.items() if k not in ("countdown", "eta")}
    body = {"task": sig.task, "args": list(sig.args), "kwargs": dict(sig.kwargs), "options": options}
    content_type, encoding, data = dumps(body, serializer=app.conf.task_serializer)
    if isinstance(data, str):
        data = data.encode(encoding if encoding != "binary" else "utf-8")
    return content_type.encode() + b"\n" + encoding.encode() + b"\n" + data


def decode_message(app: Any, message: bytes) -> dict[str, Any]:
    """The body :func:`encode_message` wrote; ValueError for anything else (a foreign
    writer, a truncated value), so that it is never sent on as a task."""
    content_type, encoding, data = message.split(b"\n", 2)
    body = loads(data, content_type.decode(), encoding.decode(), accept=prepare_accept_content(app.conf.accept_content))
    if not (isinstance(body, dict) and isinstance(body.get("task"), str) and body["task"]
            and isinstance(body.get("args"), list) and isinstance(body.get("kwargs"), dict)
            and isinstance(body.get("options"), dict)):
        raise ValueError(f"not a kept task: {str(body)[:80]!r}")
    # (Its four fields only: a kept message is one task, never a group, chain or chord a
    # ``subtask_type`` written beside them would make of it in app.signature.)
    return {field: body[field] for field in KEPT_FIELDS}


def task_of(app: Any, message: bytes) -> tuple[str, list[Any], dict[str, Any]]:
    """(task name, args, kwargs) of a kept message."""
    body = decode_message(app, message)
    return body["task"], body["args"], body["kwargs"]


def resend(app: Any, message: bytes | dict[str, Any], countdown: float = 0.0, *, key: str | None = None,
           ticket: str | None = None, queue: Any = None, producer: Any = None) -> None:
    """Send a kept message (:func:`encode_message`, or its body as :func:`decode_message`
    read it: a caller that read it already) to the broker, as its task again; with
    ``ticket``, as released from the line of state key ``key`` (its header says so); with
    ``queue`` (a kombu Queue), to that queue whatever its routes say; with ``producer``
    (one held for several sends), by it."""
    body = decode_message(app, message) if isinstance(message, bytes) else dict(message)
    options = body["options"] = dict(body["options"])
    if queue is not None:
        options = body["options"] = {k: v for k, v in options.items() if k not in _ROUTING}
    if ticket is not None:
        headers = options.get("headers")
        headers = dict(headers) if isinstance(headers, dict) else {}
        deferrals = Header.read(headers.get(HEADER)).deferrals
        headers[HEADER] = Header(key or "", ticket, deferrals).value()
        options["headers"] = headers
    sent = {"producer": producer} if producer is not None else {}
    if queue is not None:
        sent["queue"] = queue
    app.signature(body).apply_async(countdown=countdown or None, **sent)


def message_urgency(app: Any, priority: Any) -> int:
    """The urgency (:mod:`.priority`) of a message of ``app``'s broker sent with
    ``priority`` (None: none), as that broker orders its queue: Redis runs 0 first."""
    lowest_first = app.__dict__.get("_throttle_lowest_first")
    if lowest_first is None:
        try:
            lowest_first = app.connection_for_write().transport.driver_type == "redis"
        except Exception:  # noqa: BLE001 - a transport that cannot even be named: AMQP's order
            lowest_first = False
        app.__dict__["_throttle_lowest_first"] = lowest_first
    return urgency(priority, lowest_first)
