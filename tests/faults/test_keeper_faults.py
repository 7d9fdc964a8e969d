"""The journal's faults: the keeper never sends a task on twice, never sends on a task
that was purged or already ran, and keeps reading the journal, whatever fails around it
(a pass that dies after sending on, a purge whose gone cannot be written, a releaser that
writes none, a copy told it waits, a Redis Cluster store, a store restarted while no
worker ran, foreign messages in the queue, a large journal).

Each test drives the real code (a real RabbitMQ, a redis-server of the test's own, no
worker processes: the passes are run by hand, as tests/script/test_keeper.py does) and asserts
the property the journal promises (docs/design.md, "Durability"; docs/guarantees.md). Each
failed at the commit that brought the journal (ec52b6b), where a review found them.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from amqp.channel import Channel as AmqpChannel
from celery import Celery

from celery_throttle import throttle
from celery_throttle.check.limiter import Throttle
from celery_throttle.core import journal
from celery_throttle.core.errors import StoreError
from celery_throttle.core.header import HEADER, Header
from celery_throttle.core.keys import window_keys
from celery_throttle.core.timing import ScriptPolicy
from celery_throttle.integration.publish import wrap_send_task
from celery_throttle.waits.journal_pass import Pass
from celery_throttle.waits.keeper import Keeper
from tests.conftest import RABBITMQ_URL
from tests.helpers import RedisServer, SlowProxy, delete_queues, rabbitmq_or_skip, wait_for
from tests.journal_support import (
    LOST_AFTER_US,
    Deploy,
    lined,
    make_app,
    make_deploy,
    release_head,
    send,
    start,
    teardown,
)

LOOK = LOST_AFTER_US / 1e6 + 0.1



# ---------------------------------------------------------------------------------------
# 1. A pass that sends on what the store lost, then dies before its acks: the next pass
#    reads the same kept events again; it must send none of them a second time.
# ---------------------------------------------------------------------------------------
def test_a_pass_that_dies_after_sending_on_and_before_its_acks_sends_nothing_twice(
        deploy: Deploy, monkeypatch: pytest.MonkeyPatch) -> None:
    d = deploy
    send(d, 6)
    d.sent_on(1)  # (those that fit at once)
    waiting = [w.task_id for w in d.waiting()]
    assert len(waiting) >= 4
    d.lose_the_store()
    assert d.keeper.pass_now() == len(waiting)  # (marks them)
    time.sleep(LOOK)
    # Given the pass that finds them lost dies after it sent them on, before its acks (its
    # worker is stopped, its connection breaks: the messages it read go back)
    real_ack = AmqpChannel.basic_ack

    def dies(self: AmqpChannel, delivery_tag: int, multiple: bool = False) -> None:
        raise ConnectionError("the keeper's connection broke")

    monkeypatch.setattr(AmqpChannel, "basic_ack", dies)
    with pytest.raises(ConnectionError):
        d.keeper.pass_now()
    monkeypatch.setattr(AmqpChannel, "basic_ack", real_ack)
    first = d.sent_on(len(waiting))
    assert first == waiting  # (sent on once: as it should)
    # When the next passes run
    for _ in range(2):
        time.sleep(LOOK)
        d.keeper.pass_now()
    # Then nothing is sent on again
    assert d.sent_on() == [], "the tasks were sent on a second time: each would run twice"


# ---------------------------------------------------------------------------------------
# 2. An operator purges tasks from a host that reaches the store but not the broker (or
#    while the broker refuses publishes): the purge succeeds, its gone events are not
#    written (logged only); the keeper must not send the purged tasks on. No store loss.
# ---------------------------------------------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("ops_broker", ["control-reachable", "unreachable"])
def test_tasks_purged_where_the_journal_cannot_be_written_are_never_sent_on(deploy: Deploy, ops_broker: str) -> None:
    d = deploy
    send(d, 8)
    d.sent_on(1)
    waiting = d.waiting()
    assert len(waiting) >= 5
    assert d.keeper.pass_now() == len(waiting)  # (their copies are in the journal)
    # Given an operator's CLI whose broker cannot be reached (same app, same store)
    url = RABBITMQ_URL if ops_broker == "control-reachable" else f"amqp://guest:guest@127.0.0.1:{_closed_port()}//"
    ops_app = Celery("journal-review-ops", broker=url, set_as_current=False)
    ops_app.conf.broker_connection_timeout = 1
    ops = Throttle(ops_app, {"redis_url": d.server.url, "key_prefix": d.prefix, "journal": True})
    try:
        # When it purges every task waiting (the purge answers that it deleted them)
        assert ops.lines.purge(waiting) == len(waiting)
    finally:
        ops.close()
    assert d.waiting() == []
    # And the keeper looks twice, LOST_AFTER apart (the store was never lost)
    d.keeper.pass_now()
    time.sleep(LOOK)
    d.keeper.pass_now()
    # Then none of the purged tasks is sent on
    assert d.sent_on() == [], "purged tasks were sent on by the keeper: they run although purged"


# ---------------------------------------------------------------------------------------
# 3. A releaser that does not write gone events (a worker of the version before the
#    journal, during a rolling upgrade; or one with throttle_journal = False): the tasks
#    it released run, and once the store forgets them the keeper must not send them on.
# ---------------------------------------------------------------------------------------
@pytest.fixture
def short_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Deploy]:
    # (the store remembers started entries 2 s instead of 10 minutes: the same rule, sooner)
    d = make_deploy(monkeypatch, ScriptPolicy(used_keep_ms=2000))
    try:
        yield d
    finally:
        teardown(d)


@pytest.mark.parametrize("releaser_journal", [True, False], ids=["control-journaled-releaser", "no-gone-releaser"])
def test_a_task_released_by_a_worker_that_writes_no_gone_is_not_run_again(short_memory: Deploy,
                                                                          releaser_journal: bool) -> None:
    d = short_memory
    send(d, 4)
    d.sent_on(1)
    first = d.waiting()[0]
    # Given a worker that writes no journal (the version before it, or journal off)
    old_app, _ = make_app("journal-review-old", d.app.conf.broker_url, d.queue)
    old = Throttle(old_app, {"redis_url": d.server.url, "key_prefix": d.prefix, "journal": releaser_journal})
    try:
        # When it releases the head (the key raised to 2/h) and the task runs
        d.ctl.set_limit("keeper.work", ["2/h"], key="acme")
        old.checker.refresh_controls()
        old.lines.release(d.key)
    finally:
        old.close()
    (task_id, headers), = d.taken()
    assert task_id == first.task_id
    assert start(d, task_id, {HEADER: headers[HEADER]}, 0) is True  # (its body runs)
    # And, the store having forgotten it started (USED_KEEP_MS), the keeper looks twice
    time.sleep(2.5)
    d.keeper.pass_now()
    time.sleep(LOOK)
    d.keeper.pass_now()
    # Then it is not sent on again
    assert first.task_id not in d.sent_on(), "a task that ran was sent on again by the keeper"


# ---------------------------------------------------------------------------------------
# 4. A copy of a task that names an entry released meanwhile (the copy a producer sends
#    unchecked after a store error whose reply was lost, pending=<entry>; or a message
#    sent back after a store error in the pool) is that task arriving: it runs once, the
#    released message is then dropped, and the keeper never sends it on (it once was told
#    QUEUED and wrote a 'kept' no 'gone' followed).
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("copy_first", [False, True], ids=["control-no-copy", "copy-while-out"])
def test_a_copy_told_it_waits_while_its_entry_is_out_leaves_no_phantom_kept(short_memory: Deploy,
                                                                           copy_first: bool) -> None:
    d = short_memory
    send(d, 4)
    d.sent_on(1)
    first = d.waiting()[0]
    # Given the head released (gone written) and its released message in the queue
    d.ctl.set_limit("keeper.work", ["2/h"], key="acme")
    d.ctl.checker.refresh_controls()
    d.ctl.lines.release(d.key)
    (task_id, released), = d.taken()
    assert task_id == first.task_id
    # When a copy naming its entry as pending arrives first (what publish sends unchecked
    # after a lost reply): it is the released task arriving, and runs; the released
    # message, later, is a copy of a task that started, dropped. Else the released one runs.
    if copy_first:
        copy = Header(d.key, pending=first.entry).value()
        assert start(d, task_id, {HEADER: copy}, 0) is True
        assert start(d, task_id, {HEADER: released[HEADER]}, 0) is False
    else:
        assert start(d, task_id, {HEADER: released[HEADER]}, 0) is True
    # And, once the store forgot it started, the keeper looks twice
    time.sleep(2.5)
    d.keeper.pass_now()
    time.sleep(LOOK)
    d.keeper.pass_now()
    # Then it is not sent on a second time
    assert task_id not in d.sent_on(), "the task ran, and the keeper sent it on again"


# ---------------------------------------------------------------------------------------
# 5. What a pass holds in memory is about its spool's share (SPOOL_IN_MEMORY, 8 MB), not
#    the journal's bytes.
# ---------------------------------------------------------------------------------------
def test_a_pass_over_a_large_journal_holds_at_most_about_the_spool_in_memory(
        deploy: Deploy, monkeypatch: pytest.MonkeyPatch) -> None:
    d = deploy
    monkeypatch.setattr(journal, "LOST_AFTER_US", 10 ** 12)  # (nothing is sent on: memory alone)
    count, size = 1200, 64 * 1024  # (75 MB of kept messages)
    body = d.ctl.lines.journal.broker
    with d.app.producer_or_acquire() as producer:
        for n in range(count):
            body.publish(producer, journal.kept_headers(d.key, f"e{n}", 1_000_000 + n), b"x" * size, declare=n == 0)
    d.keeper.pass_now()  # (the first: adopts nothing, marks them all)
    tracemalloc.start()
    try:
        d.keeper.pass_now()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"peak {peak / 1e6:.1f} MB for {count * size / 1e6:.1f} MB of journal")
    assert peak < 3 * (8 << 20), f"a pass held {peak / 1e6:.0f} MB for a {count * size / 1e6:.0f} MB journal"


# ---------------------------------------------------------------------------------------
# 6. Redis Cluster (redis+cluster://, supported): every pass, adoption included, runs
#    there (once it ran TIME in a transaction pipeline, which redis-py refuses in cluster
#    mode: no pass ever ended, the journal grew without bound).
# ---------------------------------------------------------------------------------------
@pytest.mark.cluster
def test_the_keeper_reads_the_journal_with_a_redis_cluster_store(cluster_url: str) -> None:
    broker = rabbitmq_or_skip(RABBITMQ_URL)
    prefix = f"ct-test-{uuid.uuid4().hex[:10]}"
    app = Celery("journal-review-cluster", broker=broker, set_as_current=False)
    app.conf.task_default_queue = f"{prefix}-q"

    @app.task(name="keeper.work", shared=False)
    @throttle("1/h", key="{tenant}")
    def work(tenant: str, n: int) -> None: ...

    ctl = Throttle(app, {"redis_url": cluster_url, "key_prefix": prefix, "journal": True})
    wrap_send_task(ctl)
    keeper = Keeper(ctl.setup, ctl.lines)
    try:
        for n in range(4):
            work.delay("acme", n)
        waiting = [w for w in ctl.lines.waiting() if w.place]
        assert waiting
        assert keeper.pass_now() == len(waiting)
    finally:
        keeper._close()
        ctl.close()
        delete_queues(broker, [f"{prefix}-q", ctl.lines.journal.broker.name])


# ---------------------------------------------------------------------------------------
# 7. A store restarted while no worker ran (or a task evicted, found at a sweep): the
#    first pass marks what the store lost, and the second look is due LOST_AFTER later,
#    not at the next SWEEP_EVERY (10 minutes).
# ---------------------------------------------------------------------------------------
def test_what_a_pass_marks_is_looked_at_again_lost_after_later(deploy: Deploy) -> None:
    d = deploy
    send(d, 6)
    d.sent_on(1)
    waiting = [w.task_id for w in d.waiting()]
    assert d.keeper.pass_now() == len(waiting)
    # Given the store restarted empty while no worker ran (nobody saw its run id change)
    d.lose_the_store()
    # When a worker starts: its keeper looks every LOOK_EVERY, as its thread does
    keeper = Keeper(d.ctl.setup, d.ctl.lines)
    try:
        assert keeper.look() == len(waiting)  # (no trace of a pass: one now, which marks them)
        for _ in range(4):
            time.sleep(LOOK)
            keeper.look()
    finally:
        keeper._close()
    # Then the marked tasks were sent on once the second look was due (LOST_AFTER later)
    assert d.sent_on(len(waiting)) == waiting, "the second look waits for SWEEP_EVERY (600 s), not LOST_AFTER"


# ---------------------------------------------------------------------------------------
# 8. Hostile (or merely foreign) input in the journal queue: a message whose
#    content_encoding is text (py-amqp then hands its body over as str) is dropped, and
#    the keeper goes on (once every pass raised before its acks on it).
# ---------------------------------------------------------------------------------------
def test_a_text_message_in_the_journal_does_not_stop_the_keeper(deploy: Deploy) -> None:
    d = deploy
    send(d, 6)
    d.sent_on(1)
    waiting = [w.task_id for w in d.waiting()]
    # Given a broker client publishes one text message to the journal queue
    with d.app.producer_or_acquire() as producer:
        producer.publish("hello", exchange="", routing_key=d.ctl.lines.journal.broker.name,
                         declare=[d.ctl.lines.journal.broker.queue], content_type="text/plain",
                         content_encoding="utf-8", serializer=None,
                         headers={"ct-journal": "kept", "key": d.key, "entry": "x", "us": 1})
    # When the store is lost and the keeper looks twice
    d.lose_the_store()
    for _ in range(2):
        d.keeper.pass_now()
        time.sleep(LOOK)
    d.keeper.pass_now()
    # Then the tasks that waited are sent on (the foreign message dropped)
    assert d.sent_on(len(waiting)) == waiting
# ---------------------------------------------------------------------------------------
# 9. (Beside the journal.) A producer whose admit was RELEASED but whose reply was lost
#    sends the task unchecked, naming the entry as pending. Its worker must run it (it is
#    the released task arriving), not be told it waits and ack it while the entry is out
#    with no message kept: nothing would ever run it.
# ---------------------------------------------------------------------------------------
def test_a_copy_naming_an_entry_released_at_publish_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_throttle.core.protocol import Code, Entry
    from celery_throttle.core.timing import WORKER_BATCH
    from celery_throttle.waits.deferral import new_entry_id

    d = make_deploy(monkeypatch)
    try:
        d.ctl.configure({"journal": False})  # (a Redis broker: no journal)
        known = d.ctl.checker.known(d.app, "keeper.work", None)
        call = d.ctl.checker.bind_spec("keeper.work", known.spec, known.signature, ("acme", 0), {})
        task_id = str(uuid.uuid4())
        entry = new_entry_id(task_id)
        # Given the producer's admit RELEASED it (nothing kept) and its reply was lost
        reply = d.ctl.checker.admit(call, Entry(entry, b"", task_id, 0, 0, WORKER_BATCH))
        assert reply.code == Code.RELEASED
        # When the copy it then sends unchecked (pending=<entry>) reaches a worker
        ran = start(d, task_id, {HEADER: Header(d.key, pending=entry).value()}, 0)
        # Then it runs, or it waits in its line with its message
        in_line = [w for w in d.waiting() if w.entry == entry and w.place]
        assert ran or in_line, "the copy was told it waits (and acked), but nothing waits: the task is lost"
    finally:
        teardown(d)


def test_a_pass_cut_by_a_redis_broker_restart_gives_back_what_it_read_at_the_next_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a Redis broker that keeps its data (AOF), and tasks waiting in a line with
    # their copies in the journal
    broker = RedisServer(extra=["--appendonly", "yes", "--appendfsync", "always"]).start()
    d = make_deploy(monkeypatch, broker=broker.url)
    try:
        send(d, 8)
        d.keeper.pass_now()  # (a first pass: what it adopts and publishes again is in)
        held = d.journal_length()
        assert held >= 5
        # When a pass has read some of them and the broker restarts before it acks them
        # (a Redis broker sets messages taken and not acked aside, and gives them back
        # only after its visibility timeout: an hour by default)
        read = 0
        events = Pass._events

        def read_then_restart(message: Any, spool: Any) -> Any:
            nonlocal read
            read += 1
            if read == 3:
                broker.kill()
            return events(message, spool)

        monkeypatch.setattr(Pass, "_events", staticmethod(read_then_restart))
        with pytest.raises(Exception, match="111|[Cc]onnect"):
            d.keeper.pass_now()
        monkeypatch.setattr(Pass, "_events", staticmethod(events))
        broker.start()
        assert d.journal_length() == held - 3
        # Then the keeper's next look puts them back in the journal, where a store lost
        # later finds them
        d.keeper.look()
        assert d.journal_length() >= held
    finally:
        teardown(d)
        broker.stop()


#: A reader of the journal that dies mid-pass, as a SIGKILLed worker's keeper does: it
#: takes some messages (unacked), then exits with no cleanup (kombu's close would give
#: them back).
_DIES_MID_PASS = """
import os, sys
from kombu import Connection, Exchange, Queue
with Connection(sys.argv[1]) as conn:
    queue = Queue(sys.argv[2], Exchange(""), routing_key=sys.argv[2], durable=True)(conn.default_channel)
    taken = [queue.get(no_ack=False) for _ in range(int(sys.argv[3]))]
    print(sum(m is not None for m in taken), flush=True)
    os._exit(0)
"""


def test_what_a_keeper_killed_mid_pass_read_is_back_in_the_journal_at_the_next_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a Redis broker, and tasks waiting in a line with their copies in the journal
    broker = RedisServer(extra=["--appendonly", "yes"]).start()
    d = make_deploy(monkeypatch, broker=broker.url)
    try:
        send(d, 8)
        d.keeper.pass_now()
        held = d.journal_length()
        assert held >= 5
        # When a keeper's worker is killed mid-pass, after it took 3 of them (a Redis
        # broker sets them aside until its visibility timeout: an hour by default)
        out = subprocess.run([sys.executable, "-c", _DIES_MID_PASS, broker.url, d.ctl.lines.journal.broker.name,
                              "3"], capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.strip() == "3" and d.journal_length() == held - 3
        # Then the next pass, by any keeper, puts them back first, and reads them: a store
        # lost later finds them there
        d.keeper.pass_now()
        assert d.journal_length() >= held
    finally:
        teardown(d)
        broker.stop()


def test_a_sent_on_note_whose_reply_was_lost_does_not_keep_its_task_from_running(deploy: Deploy,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    d = deploy
    # Given tasks waiting in a line, their copies in the journal, and a store that loses
    # everything (a pass marks them, one LOST_AFTER later sends them on)
    d.ctl.configure({"journal": True})
    send(d, 6)
    waiting = d.waiting_ids()
    d.sent_on(1)
    d.keeper.pass_now()
    # (what a pass publishes again is in the journal's count a moment later: RabbitMQ
    # routes a publish after it answers the next declare, under load)
    wait_for(lambda: d.journal_length() >= len(waiting), 10, 0.05, "the copies published again")
    d.lose_the_store()
    assert d.keeper.pass_now() == len(waiting) and d.sent_on() == []
    time.sleep(LOOK)
    wait_for(lambda: d.journal_length() >= len(waiting), 10, 0.05, "the copies marked")
    # When the pass that sends them on notes the first in the store and the note's reply
    # is lost (the link cut after the server ran it): the pass fails before its send
    real = Pass._note
    calls = 0

    def note_then_lose_the_reply(self: Pass, note: str) -> bool:
        nonlocal calls
        calls += 1
        mine = real(self, note)
        if calls == 1:
            raise StoreError("Connection closed by server.")
        return mine

    monkeypatch.setattr(Pass, "_note", note_then_lose_the_reply)
    with pytest.raises(StoreError):
        d.keeper.pass_now()
    monkeypatch.setattr(Pass, "_note", real)
    # Then the next pass, of this keeper or another one (a worker's keeper elsewhere,
    # seconds later), sends every one of them on, once, that first one too (its note was
    # made, its task not sent: taken for sent, it never ran)
    time.sleep(LOOK)
    wait_for(lambda: d.journal_length() >= len(waiting), 10, 0.05, "the copies given back")
    other = Keeper(d.ctl.setup, d.ctl.lines)
    try:
        other.look()
    finally:
        other._close()
    assert sorted(d.sent_on(len(waiting))) == sorted(waiting)


# ---------------------------------------------------------------------------------------
# 10. A copy naming an entry whose fields a store evicting left, while it took the line
#     that held it (allkeys-lru takes one key of a line and may leave the others): the
#     entry is in no line, and the copy must not be told it waits there (acked, it would
#     be lost: 2 of 600 in a campaign, seed 9), but run or wait in the line again.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("line", ["evicted", "control-kept"])
def test_a_copy_naming_an_entry_whose_line_was_evicted_is_not_told_it_waits(deploy: Deploy, line: str) -> None:
    import redis


    d = deploy
    send(d, 3)
    d.sent_on(1)
    head = d.waiting()[0]
    line_key = window_keys(d.key)[2]
    with redis.Redis.from_url(d.server.url) as store:
        if line == "evicted":
            assert store.delete(line_key) == 1
        ran = start(d, head.task_id, {HEADER: Header(d.key, pending=head.entry).value()}, 0)
        in_line = store.zscore(line_key, head.entry) is not None
    assert ran or in_line, "the copy was told it waits (its message acked), but no line holds it: the task is lost"


# ---------------------------------------------------------------------------------------
# 9. A store taken back to before a release (a failover to a replica short of it, or a
#    releaser that died between its send and its ack) holds the released task in its line
#    again: the journal's gone names it, and the keeper's pass takes it out, or the line
#    sends it a second time.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pass_between", [True, False], ids=["taken-back", "control-no-pass"])
def test_a_release_a_failover_lost_is_not_sent_a_second_time(deploy: Deploy, monkeypatch: pytest.MonkeyPatch,
                                                            pass_between: bool) -> None:
    d = deploy
    monkeypatch.setattr(journal, "TAKE_BACK_AFTER_US", 0)  # (30 s: a send lease and a put-back's copy)
    waiting = lined(d, 4)
    assert len(waiting) == 3
    d.keeper.pass_now()
    # Given a replica that has everything up to now
    with redis.Redis.from_url(d.server.url) as store:
        replica = {key: (store.dump(key), store.pttl(key)) for key in store.scan_iter()}
    # When the head is released (the key raised to 2/h) and sent, its gone in the journal,
    # and the store fails over to that replica, short of the release
    release_head(d)
    assert d.sent_on(1) == waiting[:1]
    with redis.Redis.from_url(d.server.url) as store:
        for key in store.scan_iter():
            if key not in replica:
                store.delete(key)
        for key, (value, ttl) in replica.items():
            store.restore(key, max(ttl, 0), value, replace=True)
        assert store.zscore(window_keys(d.key)[2], d.waiting()[0].entry) is not None  # (back in its line)
    # And the keeper makes a pass (or none yet), and the key is raised again and released
    if pass_between:
        d.keeper.pass_now()
    release_head(d)
    # Then the next task is sent, not the head a second time (without a pass: sent twice)
    sent = d.sent_on(1)
    assert sent == (waiting[1:2] if pass_between else waiting[:1])
    assert d.waiting_ids() == (waiting[2:] if pass_between else waiting[1:])


@pytest.mark.parametrize("pass_between", [True, False], ids=["taken-back", "control-no-pass"])
def test_a_release_whose_releaser_died_before_its_ack_is_not_sent_again(
        monkeypatch: pytest.MonkeyPatch, pass_between: bool) -> None:
    d = make_deploy(monkeypatch, ScriptPolicy(send_lease_ms=300))
    monkeypatch.setattr(journal, "TAKE_BACK_OUT_AFTER_US", 0)  # (5 s: longer than a releaser defers its acks)
    try:
        waiting = lined(d, 4)
        # Given the head released and sent, its gone in the journal, and its releaser killed
        # before its ack to the store: released and not acked
        release_head(d)
        d.ctl.lines._unacked.clear()  # (its ack waited for the key's next release, in a releaser killed)
        assert d.sent_on(1) == waiting[:1]
        # When the keeper makes a pass (or none), and the send lease runs out, and the line
        # is released again
        if pass_between:
            d.keeper.pass_now()
        time.sleep(0.4)
        d.ctl.lines.release(d.key)
        # Then the next task is sent, not the head a second time (without a pass: its
        # release, taken for one its releaser never sent, goes back to its place and again)
        assert d.sent_on(1) == (waiting[1:2] if pass_between else waiting[:1])
    finally:
        teardown(d)


@pytest.mark.parametrize("waits", [True, False], ids=["held-on-the-replica", "control-no-wait"])
def test_a_release_is_held_on_the_replica_before_its_task_is_sent(deploy: Deploy, monkeypatch: pytest.MonkeyPatch,
                                                                 waits: bool) -> None:
    from celery_throttle.store import lines as store_lines
    from celery_throttle.store.client import RedisStore

    d = deploy
    monkeypatch.setattr(store_lines, "REPLICA_WAIT_MS", 6000)  # (100 ms: a replica on a sound link)
    if not waits:
        monkeypatch.setattr(RedisStore, "hold_on_replica", lambda self: 0)
    # Given a replica of the store that hears the primary 1 s late (a link of 2 s there and
    # back: without the wait, the release must not reach it before the link dies, and on a
    # loaded machine the send and the journal's note took more than the 0.2 s of a 0.4 s
    # link), holding the line of 3 tasks waiting
    link = SlowProxy(d.server.url, 2000).start()
    replica = RedisServer(extra=["--replicaof", "127.0.0.1", str(link.port)]).start()
    try:
        lined(d, 4)
        head = d.waiting()[0]
        line, out = window_keys(d.key)[2], window_keys(d.key)[4]
        with redis.Redis(port=replica.port) as copy:
            wait_for(lambda: copy.zcard(line) == 3, 20, 0.1, what="the line on the replica")
            # When the head is released and sent, and the link and the primary die at once
            # (the replica promoted: a failover)
            release_head(d)
            link.stop()
            d.server.kill()
            assert d.sent_on(1) == [head.task_id]
            copy.replicaof("NO", "ONE")
            # Then the new primary holds the release (without the wait: the head in its
            # line, to be sent a second time)
            assert (copy.zscore(out, head.entry) is not None) == waits
            assert (copy.zscore(line, head.entry) is None) == waits
    finally:
        link.stop()
        replica.stop()


def test_a_copy_naming_its_entry_that_starts_after_a_store_loss_is_not_sent_on_again(deploy: Deploy) -> None:
    d = deploy
    # Given a task waiting in its key's line, its copy in the journal
    lined(d, 2)
    head, = d.waiting()
    d.keeper.pass_now()
    # When the store loses its state, and the task's message sent back after a store error
    # (naming its entry) arrives and starts, as a fresh call
    d.lose_the_store()
    assert start(d, head.task_id, {HEADER: Header(d.key, pending=head.entry).value()}, 1) is True
    # Then the keeper's passes do not send it on from its copy (it ran twice so: the
    # store's epoch is new, and its copy said it waits)
    d.keeper.pass_now()
    time.sleep(LOOK)
    d.keeper.pass_now()
    assert head.task_id not in d.sent_on()
