"""The journal in a real RabbitMQ and the keeper's passes over it, with a store of the
test's own that loses everything (no worker: the passes are run by hand, and the tasks
the keeper sends on are read back from their queue).

A producer sends tasks of a spent key (1/h): they wait in its line, kept in the journal;
the store is emptied; a pass finds it does not know them and marks them, a pass
``LOST_AFTER`` later sends each on, in the order they joined, once.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from amqp.channel import Channel as AmqpChannel

from celery_throttle.core.errors import StoreError
from celery_throttle.core.keys import state_key
from tests.journal_support import (
    LOST_AFTER_US,
    Deploy,
    lined,
    send,
)


def test_tasks_that_waited_before_the_journal_are_adopted_and_sent_on_once_in_order_when_the_store_is_lost(
        deploy: Deploy) -> None:
    d = deploy
    # Given tasks waiting in a line, written with the journal off (an earlier release, or
    # a Redis broker before the move to RabbitMQ)
    send(d, 8)
    waiting = d.waiting_ids()
    assert len(waiting) >= 5, waiting
    first_sent = d.sent_on()  # (those that fit at once)
    # When the journal is turned on, a first pass adopts them
    d.ctl.configure({"journal": True})
    assert d.keeper.pass_now() == len(waiting)
    assert d.journal_length() == len(waiting)
    # (while the store holds them, passes however far apart send nothing on)
    for _ in range(2):
        time.sleep(LOST_AFTER_US / 1e6 + 0.1)
        assert d.keeper.pass_now() == len(waiting) and d.sent_on() == []
    # And the store loses everything
    d.lose_the_store()
    # Then a pass marks them and sends nothing; one LOST_AFTER later sends each on once,
    # in the order they waited; another sends nothing more, and the journal is empty
    assert d.keeper.pass_now() == len(waiting)
    assert d.sent_on() == []
    time.sleep(LOST_AFTER_US / 1e6 + 0.1)
    assert d.keeper.pass_now() == 0
    assert d.sent_on() == waiting
    # (what is left of it: the gone of each task sent on, kept a while, in one message)
    assert d.keeper.pass_now() == 0 and d.sent_on() == [] and d.journal_length() <= 1
    assert first_sent and not set(first_sent) & set(waiting)


def test_a_task_purged_or_released_is_never_sent_on_and_those_that_waited_are(deploy: Deploy) -> None:
    d = deploy
    # Given the journal on, tasks waiting in a line; one released (the key raised to 2/h:
    # room for one beside the one that fit at once), two purged by an operator
    d.ctl.configure({"journal": True})
    send(d, 8)
    d.sent_on()
    waiting = d.waiting_ids()
    d.ctl.set_limit("keeper.work", ["2/h"], key="acme")
    d.ctl.checker.refresh_controls()
    d.ctl.lines.release(state_key(d.ctl.settings.key_prefix, "keeper.work", "acme"))
    released = d.sent_on()
    assert released == waiting[:1]
    purged = [w for w in d.ctl.lines.waiting() if w.place][:2]
    assert d.ctl.lines.purge(purged) == 2
    left = d.waiting_ids()
    assert left == waiting[3:]
    # When the store loses everything, and two passes LOST_AFTER apart look
    d.lose_the_store()
    d.keeper.pass_now()
    time.sleep(LOST_AFTER_US / 1e6 + 0.1)
    d.keeper.pass_now()
    # Then only those still waiting are sent on, each once, in order
    assert d.sent_on() == left


def test_a_pass_that_dies_before_its_acks_loses_nothing_and_sends_nothing_twice(
        deploy: Deploy, monkeypatch: pytest.MonkeyPatch) -> None:
    d = deploy
    d.ctl.configure({"journal": True})
    send(d, 6)
    d.sent_on()
    waiting = d.waiting_ids()
    d.lose_the_store()
    # Given a pass that dies before its acks (its messages go back to the journal, beside
    # what it published again), twice
    real_ack = AmqpChannel.basic_ack

    def dies(self: AmqpChannel, delivery_tag: int, multiple: bool = False) -> None:
        raise ConnectionError("the keeper's connection broke")

    for _ in range(2):
        monkeypatch.setattr(AmqpChannel, "basic_ack", dies)
        with pytest.raises(ConnectionError):
            d.keeper.pass_now()
        monkeypatch.setattr(AmqpChannel, "basic_ack", real_ack)
        time.sleep(LOST_AFTER_US / 1e6 + 0.1)
    # When passes run again
    for _ in range(3):
        d.keeper.pass_now()
        time.sleep(LOST_AFTER_US / 1e6 + 0.1)
    # Then each task that waited is sent on once, in order
    assert d.sent_on() == waiting


def test_messages_of_another_writer_in_the_journal_are_dropped_and_send_nothing(deploy: Deploy) -> None:
    d = deploy
    d.ctl.configure({"journal": True})
    # Given the journal's queue with messages nobody of ours wrote in it (a forged kept
    # event included: its fields out of shape)
    producer_app = d.app
    with producer_app.producer_or_acquire() as producer:
        broker = d.ctl.lines.journal.broker
        broker.publish(producer, {}, b"hello", declare=True)
        broker.publish(producer, {"ct-journal": "kept", "key": "x", "entry": "e", "us": "soon"}, b"body")
        broker.publish(producer, {"ct-journal": "gone"}, b"[not json")
    # When passes run, the store empty
    d.keeper.pass_now()
    time.sleep(LOST_AFTER_US / 1e6 + 0.1)
    d.keeper.pass_now()
    # Then nothing is sent on and nothing is left
    assert d.sent_on() == [] and d.journal_length() == 0  # (nothing of ours in it)


def test_a_task_that_left_its_line_without_a_word_is_dropped_and_named(deploy: Deploy,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    d = deploy
    d.ctl.configure({"journal": True})
    waiting = lined(d, 6)
    # Given one waiting task taken out of its line by a process with the journal off (no
    # gone reaches the journal), the store keeping its epoch
    gone = next(w for w in d.ctl.lines.waiting() if w.place)
    d.ctl.configure({"journal": False})
    assert d.ctl.lines.purge([gone]) == 1
    d.ctl.configure({"journal": True})
    # When two passes LOST_AFTER apart look
    caplog.set_level("INFO", logger="celery_throttle")
    assert d.keeper.pass_now() == len(waiting)
    time.sleep(LOST_AFTER_US / 1e6 + 0.1)
    assert d.keeper.pass_now() == len(waiting) - 1
    # Then it is not sent on, the others still wait, and the pass names the copy it drops
    assert d.sent_on() == [] and d.waiting_ids() == [w for w in waiting if w != gone.task_id]
    named = [r.getMessage() for r in caplog.records if "left its line without a word" in r.getMessage()]
    assert len(named) == 1 and gone.entry in named[0], named


def test_a_keeper_whose_pass_failed_passes_again_at_its_next_look(deploy: Deploy,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    d = deploy
    d.ctl.configure({"journal": True})
    waiting = lined(d, 6)
    assert d.keeper.pass_now() == len(waiting)
    assert d.keeper.look() is None  # (nothing due: the journal has not grown, nothing is suspect)
    # Given a pass that fails mid-way (a store reply lost as it asks which entries the
    # store holds): what it read goes back to the journal unjudged
    store = d.ctl.setup.store

    def lost_reply(*_: Any) -> list[bool]:
        raise StoreError("a reply lost on the link")

    monkeypatch.setattr(store, "known_entries", lost_reply)
    with pytest.raises(StoreError):
        d.keeper.pass_now()
    monkeypatch.undo()
    # When its keeper looks next, though the store's state says no pass is due
    # Then it makes a pass, and looks stay quiet once one has ended
    assert d.keeper.look() == len(waiting)
    assert d.keeper.look() is None
