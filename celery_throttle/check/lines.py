"""Lines, this process's side: what a call on a key's line hands back, and the look at
keys whose head may go.

A call of window.lua may release tasks of its key's line on its way (a refund, a body
that ends, a task that arrives): the caller sends each to the broker with its ticket
(:meth:`Lines.handle`), says which were sent (``ack``: until then a releaser that died
between the script and the broker leaves them to be put back), and reports those that
cannot run. When a reply says the key's next look moved, the caller tells the index of
keys with a line (index.lua), and wakes a releaser if that look is soon.

The releasers (:mod:`.releaser`, one thread per worker) claim the keys that are due and
run their line's ``release``; to build the call they run it as, a process binds the
task at the head of the line (or one it saw of that key) as its own worker would.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from contextlib import ExitStack, suppress
from typing import TYPE_CHECKING, Any

from ..celery_parts.hand import Hand
from ..celery_parts.messages import decode_message, resend, task_of
from ..core.errors import StoreError, ThrottleError
from ..core.journal import Kind
from ..core.keys import scope_state_patterns, target_of
from ..core.locks import ForkSafeLock
from ..core.protocol import Code, Verdict, WindowReply
from ..core.spec import BoundCall
from ..core.timing import RELEASER_BATCH
from .journaling import Journaling
from .lines_on_call import OnCall

if TYPE_CHECKING:
    from .checker import Checker
    from .setup import Setup

__all__ = ["Lines"]

logger = logging.getLogger("celery_throttle")

#: Keys whose task this process remembers, to bind a release of their line (the least
#: recently seen are forgotten: a worker of many tenants must not grow without bound), and
#: the largest message whose task it remembers (a task of large arguments is read again).
CALLS_KEPT, CACHED_MESSAGE = 10_000, 4096
#: For this long (seconds) after a call of a key had to wait, a task of that key sends its
#: message with its first try.
FULL_HINT_S = 1.0
#: The tasks a releaser sent are acked in the store by its next release of their key (one
#: call, not two), or on their own once the oldest was sent this long ago (seconds): well
#: within the send lease (10 s), after which the store puts a release never acked back in
#: its place (its releaser died before sending it).
ACK_DEFER_S = 2.0
#: A key whose line this process cannot release (no task of it is known here) is looked at
#: again this long after (µs), by whichever releaser claims it first.
UNKNOWN_RETRY_US = 5_000_000


class Lines(OnCall):
    """The lines of one app, as this process sees them."""

    def __init__(self, setup: Setup, checker: Checker) -> None:
        self.setup, self.checker = setup, checker
        self._lock = ForkSafeLock()
        #: state key -> (task name, args, kwargs) of a task of its line.
        self._calls: OrderedDict[str, tuple[str, Any, Any]] = OrderedDict()
        #: state key -> when a call of it last had to wait (monotonic seconds).
        self._full_at: dict[str, float] = {}
        #: The copy of every task waiting in a line in the broker (when on).
        self.journal = Journaling(setup)
        #: This worker's own queue, for the task a body's end releases (a worker's only).
        self.hand = Hand()
        #: state key -> [its call, tickets its releaser sent and has not acked, since when
        #: (monotonic)]: acked by the key's next release, or by :meth:`ack_overdue`.
        self._unacked: dict[str, list[Any]] = {}

    # -- whether a task's message goes with its first try ---------------------------------
    def looks_full(self, call: BoundCall) -> bool:
        """Whether a call of ``call``'s key had to wait a moment ago (FULL_HINT_S): its task's
        message then goes with its first try (one call, not two, for a task that waits)."""
        return time.monotonic() - self._full_at.get(call.state_key, float("-inf")) < FULL_HINT_S

    def full(self, call: BoundCall) -> None:
        """A call of ``call``'s key had to wait."""
        if len(self._full_at) >= CALLS_KEPT and call.state_key not in self._full_at:
            self._full_at.clear()
        self._full_at[call.state_key] = time.monotonic()

    def tries(self, call: BoundCall, *, message_first: bool = False) -> tuple[bool, ...]:
        """Whether a task's message goes with each try of its check (the hook's acquire or
        claim, the screen's, publish's admit): with the first when its key was full a moment
        ago (or ``message_first``), else with a second only if it must wait. Each try's
        reply goes to :meth:`checked`; the last reply's verdict is the one to act on."""
        return (True,) if message_first or self.looks_full(call) else (False, True)

    def checked(self, call: BoundCall, reply: WindowReply) -> bool:
        """One try of a task's check answered ``reply``: the tasks it released are sent
        (:meth:`handle`), a key where it waits is marked full. False: not kept without its
        message (try again with it)."""
        self.handle(call, reply)
        verdict = reply.verdict
        # (Only a task that waits marks it: a first try denied without its message is not
        # a line yet. Marked full, publish gives the message with its first try, and an
        # admit with a message releases a task that fits, with a ticket, where it would
        # have let it go unchecked: a claim and a remembered entry more per task.)
        if verdict is Verdict.WAITS:
            self.full(call)
        return verdict is not Verdict.NOT_KEPT

    # -- what a call hands back ------------------------------------------------------------
    def handle(self, call: BoundCall, reply: WindowReply, *, here: bool = False, defer_ack: bool = False) -> int:
        """Send the tasks ``reply`` released (each with its ticket), report the others,
        ack those sent and tell the index what the reply says. Returns how many were sent.
        ``here``: this worker has a process for the first task released (a body of this
        process just ended, or one is idle): it goes to this worker's own queue if it takes it (:mod:`..celery_parts.hand`; not acked: put
        back in its place if it does not arrive within the send lease). ``defer_ack`` (a
        releaser): those sent are acked by the key's next release, or within ACK_DEFER_S.
        Never raises: a
        task that could not be sent is put back in its place after the send lease, and
        the index hears of the key from its next call."""
        sent: list[str] = []
        handed = 0
        gone: list[str] = []  # (sent to the broker, or buried: out of their lines for good)
        lost: list[str] = []  # (their messages gone from the store: the journal has a copy)
        app, metrics = self.setup.app, self.setup.metrics
        if any(task.kind in ("r", "x", "c") for task in reply.reported):
            # (Before any is sent: a failover to a replica short of this release would hold
            # them in their lines again, and send them a second time.)
            self.setup.store.hold_on_replica()
        # (One producer for every task this reply released, taken when the first is sent.)
        sends = ExitStack()
        producer = None
        for task in reply.reported:
            if task.kind in ("r", "x", "c") and isinstance(task.payload, bytes):
                try:
                    body = decode_message(app, task.payload)
                except Exception:  # noqa: BLE001 - a message no serializer reads: not sent, not lost
                    self._bury(call, task.id, task.payload, task.kind == "r")
                    gone.append(task.id)
                    continue
                try:
                    if producer is None:
                        producer = sends.enter_context(app.producer_or_acquire())
                    if task.kind == "r" and here and not handed and self._hand(body):
                        # (Its journal copy stays until it starts: the hook says it is gone.)
                        resend(app, body, key=call.state_key, ticket=task.id, queue=self.hand.queue,
                               producer=producer)
                        handed += 1
                    elif task.kind == "r":
                        resend(app, body, key=call.state_key, ticket=task.id, producer=producer)
                        sent.append(task.id)
                        gone.append(task.id)
                    else:
                        # (expired while it waited, or costing more than the limit now in
                        # force: sent as it is, its worker discards it, or fails it visibly)
                        if task.kind == "c":
                            logger.error("a task waiting in the line of scope %r%s costs more than its limit in "
                                         "force now: it is sent on, and its worker fails it", call.scope,
                                         "" if call.key is None else f" key {call.key!r}")
                        resend(app, body, producer=producer)
                        gone.append(task.id)
                except Exception:
                    logger.exception("could not send task %s released from the line of %s; it is put back "
                                     "in its place", task.id, call.state_key)
                    # (the producer goes back as a send's own would after an error: its
                    # connection replaced in the pool; the next task takes another)
                    with suppress(Exception):
                        sends.__exit__(*sys.exc_info())
                    sends, producer = ExitStack(), None
            elif task.kind == "l":
                lost.append(task.id)
                logger.error("task %s waited in the line of scope %r%s, but its message is gone from the store "
                             "(evicted, or deleted by hand): %s", task.payload, call.scope,
                             "" if call.key is None else f" key {call.key!r}",
                             "the journal sends it on at its next pass" if self.journal.enabled else "it cannot run")
                metrics.lost()
            elif task.kind == "f":
                logger.warning("task %s was released from the line of scope %r%s and has not started within "
                               "%.0fs: its room is given back; if it still comes, it is checked as a new task",
                               task.payload, call.scope, "" if call.key is None else f" key {call.key!r}",
                               self.setup.store.policy.out_lease_ms / 1000)
        self.journal.gone(call.state_key, gone, reply.now_us, producer=producer)
        self.journal.gone(call.state_key, lost, reply.now_us, Kind.LOST, producer)
        with suppress(Exception):  # (never raises: what was sent is sent)
            sends.close()
        if sent or handed:
            metrics.released(len(sent) + handed)
        # The index first: a key that joins its share is woken by the sharer's pass that
        # raises its cap, and a wake-up finds only a key the index holds. (Joined first, a
        # pass could raise it before this note, and the note then held its look until
        # never: a one-off tenant's task waited for good, 1 in 10 runs under load.) Each
        # told apart: a key whose join failed is still looked at, and joins again then.
        for tell in (lambda: self._tell_index(call, reply), lambda: self._join(call, reply),
                     lambda: self._acks(call, sent, defer_ack)):
            try:
                tell()
            except (StoreError, ThrottleError) as exc:
                logger.warning("could not tell the store about the line of %s: %s", call.state_key, exc)
        return len(sent) + handed

    def _join(self, call: BoundCall, reply: WindowReply) -> None:
        """A key with tasks waiting and no cap takes part in its scope's share from now on,
        and the sharer's next pass gives it one."""
        if call.share is not None and reply.waiting and not reply.slot_cap:
            self.setup.store.share_join(call.scope, call.state_key, *call.share)

    def _tell_index(self, call: BoundCall, reply: WindowReply) -> None:
        if reply.tell_index:
            self.note(call.state_key, reply.due_us, reply.now_us)

    def _acks(self, call: BoundCall, sent: list[str], defer_ack: bool) -> None:
        """The tasks released with ``sent`` were sent: acked now, or (``defer_ack``, a
        releaser) by the key's next release, or within ACK_DEFER_S."""
        if sent and defer_ack:
            with self._lock:
                self._unacked.setdefault(call.state_key, [call, [], time.monotonic()])[1].extend(sent)
        elif sent:
            self._ack(call, sent)

    def _ack(self, call: BoundCall, tickets: list[str]) -> None:
        """The tasks released with ``tickets`` were sent (raises as the store does)."""
        acked = self.checker.ack(call, tickets)
        # (Else a failover to a replica short of the ack would take them for never sent, at
        # their send lease's end, and send them again.)
        self.setup.store.hold_on_replica()
        if acked.tell_index:
            # (Its own look may move the key's due time earlier: what it sent is now out
            # for longer. Never dropped: the index would keep the later one.)
            self.note(call.state_key, acked.due_us, acked.now_us)

    def ack_overdue(self, everything: bool = False) -> int:
        """Ack the tasks a releaser sent ACK_DEFER_S ago or more whose key it has not
        released since (``everything``: all, a releaser that stops). Returns how many keys."""
        now = time.monotonic()
        with self._lock:
            keys = [k for k, (_, _, since) in self._unacked.items() if everything or now - since >= ACK_DEFER_S]
            overdue = [self._unacked.pop(k) for k in keys]
        for call, tickets, _ in overdue:
            try:
                self._ack(call, tickets)
            except (StoreError, ThrottleError) as exc:
                logger.warning("could not ack the tasks sent from the line of %s (the store puts them back in "
                               "their places after the send lease, and sends them again): %s", call.state_key, exc)
        return len(overdue)

    def _hand(self, body: dict[str, Any]) -> bool:
        """Whether this worker takes the task of message ``body`` from its own queue."""
        if self.hand.queue is None:
            return False
        return self.hand.takes(self.setup.app, body["task"], body["args"], body["kwargs"], body["options"])

    def _bury(self, call: BoundCall, entry: str, message: bytes, released: bool) -> None:
        """A message of ``call``'s line that cannot be decoded: kept as a dead letter, and its
        room given back. Never raises."""
        logger.error("a task waiting in the line of scope %r%s has a message that cannot be decoded: it is kept "
                     "as a dead letter (throttle parked --dead)", call.scope,
                     "" if call.key is None else f" key {call.key!r}")
        self.setup.metrics.lost()
        try:
            self.setup.store.bury(entry, message)
            if released:
                self.handle(call, self.checker.give_back(call, entry))
        except (StoreError, ThrottleError) as exc:
            logger.warning("could not keep the dead letter %s: %s", entry, exc)

    def note(self, key: str, due_us: int, now_us: int) -> None:
        """Tell the index when ``key`` next needs a look (as its line's script computed it
        at ``now_us``), and wake a releaser if soon."""
        read_us = self.checker.controls.read_at_us
        store = self.setup.store
        if store.index_note(key, due_us, now_us, read_us) and due_us - now_us < store.policy.wake_ahead_ms * 1000:
            store.wake_releasers(store.index_part(key), due_us if due_us > now_us else None)

    def wake_releasers(self) -> None:
        """Wake one releaser now (it looks at every key due)."""
        self.setup.store.wake_releasers()

    def wake(self, scope: str | None, key: str | None = None) -> int:
        """Something gave ``scope`` (or its ``key``; None: every scope) room (a raised or
        cleared limit, a reset, a resume, shadow mode): every line of it gets a look now.
        Returns how many."""
        store = self.setup.store
        prefix = self.setup.settings.key_prefix
        patterns = ["*"] if scope is None else scope_state_patterns(prefix, scope, key)
        woken = 0
        for pattern in patterns:
            batch: list[str] = []
            for member in store.indexed(pattern):
                batch.append(member)
                if len(batch) >= 500:
                    woken += store.index_wake(batch)
                    batch = []
            woken += store.index_wake(batch)
        if woken:
            self.wake_releasers()
        return woken

    # -- releasing --------------------------------------------------------------------------
    def call_for(self, key: str) -> BoundCall | None:
        """The call a release of ``key``'s line runs as: the task at the head of its line
        (or one released from it) bound as its worker binds it, under the live limits of
        now. None: no task of it is known here."""
        with self._lock:
            seen = self._calls.get(key)
        if seen is None:
            message = self.setup.store.sample(key)
            if message is None:
                return None
            try:
                seen = task_of(self.setup.app, message)
            except Exception:  # noqa: BLE001 - a message we cannot read is reported by the release
                return None
            if len(message) <= CACHED_MESSAGE:
                with self._lock:
                    self._calls[key] = seen
                    while len(self._calls) > CALLS_KEPT:
                        self._calls.popitem(last=False)
        name, args, kwargs = seen
        known = self.checker.known(self.setup.app, name, None)
        if known is None:
            return None
        try:
            call = self.checker.bind_spec(name, known.spec, known.signature, args, kwargs)
        except ThrottleError:
            return None
        return call if call.state_key == key else None

    def release(self, key: str, *, drain: bool = False) -> tuple[int, int]:
        """Release the heads of ``key``'s line that fit (``drain``: whatever the room), and
        send them. Returns when the key next needs a look (µs, Redis clock; 0: nothing
        waits), and when that was computed (the script's now), under controls this
        process read at :attr:`.controls.Controls.read_at_us`."""
        call, batch = self.call_for(key), RELEASER_BATCH
        if call is None:
            store = self.setup.store
            # (The clock before the counts: a line that begins after them has a note newer
            # than this look, which its settle then cannot undo. Read after them, a line
            # begun between the two reads was settled as empty, newer than its own note,
            # and left the index with its tasks waiting.)
            now_us = store.now_us()
            waiting, out = store.line_counts(key)
            if waiting and store.sample(key) is not None:
                logger.debug("no task of the line %s is known here: left to another worker", key)
                return now_us + UNKNOWN_RETRY_US, now_us
            if not waiting and not out:
                return 0, now_us
            # No message to bind: only tasks released and not started (a call of no rate
            # puts back or forgets those whose time is up), or a head whose message is gone
            # (evicted: its line would wait on it for good). The call's batch, negative,
            # lets only heads whose message is gone go, reported lost (the journal sends
            # them on); a head that has its message stays, to be released under its own
            # rates at the next look (line.lua, release_heads).
            target = target_of(self.setup.settings.key_prefix, key)
            if target is None:
                return 0, now_us
            call, batch = BoundCall(target[0], target[1], (), 1, "sliding", key), -RELEASER_BATCH
        drain = drain or call.shadow  # (switched to shadow mode: whatever waits goes)
        with self._lock:
            unacked = self._unacked.pop(key, None)
        try:
            reply = self.checker.release(call, batch, drain=drain, sent=unacked[1] if unacked else ())
        except BaseException:
            if unacked is not None:  # (acked by the next try, or within ACK_DEFER_S)
                with self._lock:
                    self._unacked.setdefault(key, [call, [], unacked[2]])[1][:0] = unacked[1]
            raise
        if unacked is not None and not any(task.kind in ("r", "x", "c") for task in reply.reported):
            self.setup.store.hold_on_replica()  # (the acks it carried: see _ack)
        # (A slot a release fills is held until its task starts: where a process is idle.)
        self.handle(call, reply, here=call.concurrency > 0 and not drain and self.hand.idle(), defer_ack=True)
        if reply.code == Code.RUN and drain and reply.waiting:
            return reply.now_us, reply.now_us  # (more to drain: at once)
        return reply.due_us, reply.now_us
