"""Tasks parked by earlier versions (header formats 1 and 2), sent on after an upgrade.

Those versions parked a denied task whose wait was long: its message in Redis by due time
(``{parked}`` keys), or in RabbitMQ's delay queues, and a task a pause held in
``<prefix>.held``. This version keeps every waiting task in its key's line instead; what
they left is released here by every worker's releaser as it comes due (a parked message
taken under a lease, sent back, then acked: a releaser that dies loses nothing), and the
worker that gets one checks it as a new task. A parked message that cannot be decoded or
sent is tried MAX_ATTEMPTS times, then kept as a dead letter (``throttle parked --dead``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..celery_parts.messages import resend
from ..core.keys import PARKED_TAG_END

if TYPE_CHECKING:
    from ..check.parts import Parts

__all__ = ["BATCH", "MAX_ATTEMPTS", "parked_task_id", "release_parked"]

logger = logging.getLogger("celery_throttle")
#: How long (seconds) a worker holds parked messages it took, to send them back; if it
#: dies first, they are handed out again after this.
_LEASE_S = 60.0
#: Messages taken per release call.
BATCH = 500
#: Sent messages are acked this many at a time: a release cut short (its worker killed)
#: re-releases at most these.
_ACK_EVERY = 16
#: Times a parked message is handed out at most (each time it could not be sent back,
#: or its worker died holding it) before it is a dead letter, kept for the CLI
#: (``celery throttle parked --dead``) instead of coming back forever.
MAX_ATTEMPTS = 5


def parked_task_id(parked_id: str) -> str:
    """The task id in a parked id (``[tag|]task id:suffix``)."""
    return parked_id.rpartition(PARKED_TAG_END)[2].rpartition(":")[0]


def release_parked(ctl: Parts) -> int:
    """Send back what is parked and due within the next interval (a pause an earlier
    version parked behind is this version's to check: every one is due now); returns how
    many were taken."""
    interval = ctl.settings.release_interval
    lookahead_us = int(interval * 1.5 * 1e6)
    now_us, items = ctl.parking.release(lookahead_us, BATCH, int(_LEASE_S * 1e6), MAX_ATTEMPTS)
    sent, unacked = 0, []
    for parked_id, due_us, message in items:
        if message is None:
            logger.error("parked task %s was due but its message is gone from the store (evicted, or "
                         "deleted by hand): it cannot run; kept as a dead letter (throttle parked --dead)",
                         parked_task_id(parked_id))
            ctl.metrics.lost()
            continue
        try:
            resend(ctl.app, message, max(due_us - now_us, 0) / 1e6)
        except Exception:  # anything this message does: the others still go
            logger.exception("could not send parked task %s back; it will be tried again", parked_id)
            ctl.parking.retry_later([parked_id], now_us + int(interval * 2 * 1e6))
            continue
        unacked.append(parked_id)
        sent += 1
        if len(unacked) >= _ACK_EVERY:
            ctl.parking.ack(unacked)
            unacked = []
    ctl.parking.ack(unacked)
    if sent:
        logger.info("released %d task(s) parked by an earlier version", sent)
        ctl.metrics.released(sent)
    return len(items)
