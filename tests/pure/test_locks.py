"""Locks a forked child inherits: a prefork pool forks its processes from the worker's main
process while threads of ours run there, and a lock one of them held at that instant must
not stay held in the child (its first check would wait for ever)."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery

import celery_throttle
from celery_throttle.check import controller as controllers
from celery_throttle.check import metrics
from celery_throttle.core.locks import ForkSafeLock
from tests.helpers import STORE_URL

#: How long the child of a fork may take to get its locks and run a check (seconds).
CHILD_S = 10


def _fork_while_held(locks: list, in_child: Callable[[], None]) -> int:
    """Fork while another thread holds ``locks``; the child runs ``in_child`` under an
    alarm. Returns the child's exit status: 0 if it ran, 3 on a timeout, 4 on an error."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        done.wait(30)
        for lock in reversed(locks):
            lock.release()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        import signal

        signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
        signal.alarm(CHILD_S)
        try:
            in_child()
        except BaseException:  # noqa: BLE001 - the status says it
            import traceback

            traceback.print_exc()
            os._exit(4)
        os._exit(0)
    done.set()
    holder.join(5)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_lock_another_thread_held_at_the_fork_is_free_in_the_child() -> None:
    lock = ForkSafeLock()

    def take() -> None:
        if not lock.acquire(timeout=CHILD_S / 2):
            os._exit(3)

    assert _fork_while_held([lock], take) == 0
    assert not lock.locked()  # (and the parent's is its own, given back by its holder)


@pytest.mark.script
def test_a_child_forked_while_every_lock_of_a_controller_was_held_checks_and_reports(
        prefix: str, store_client: redis.Redis) -> None:
    # Given a controller that has run a check (its store, lines, metrics and controls made)
    app = Celery(f"fork-{prefix}", set_as_current=False)
    ctl = celery_throttle.install(app, redis_url=STORE_URL, key_prefix=prefix)
    assert ctl.acquire("forked", rates=["50/s"]).allowed
    locks = [ctl.setup._lock, ctl.store._lock, ctl.lines._lock, ctl.metrics._lock, ctl.checker.controls._lock,
             ctl.slots._lock, controllers._lock, metrics._instruments_lock]
    assert all(isinstance(lock, ForkSafeLock) for lock in locks)

    # When a pool process is forked while another thread holds each of them
    def check() -> None:
        child = controllers.controller(app)
        assert child.acquire("forked", rates=["50/s"]).allowed
        child.checker.refresh_controls()
        child.metrics.admitted("forked", None)
        assert child.status("forked").rates

    # Then the child takes each of them, checks a call against Redis and reports it
    assert _fork_while_held(locks, check) == 0


def test_every_lock_of_the_package_is_fork_safe() -> None:
    package = Path(celery_throttle.__file__).parent
    modules = sorted(package.rglob("*.py"))
    assert len(modules) > 30, f"the package's modules were not all found: {modules}"
    bare = [f"{path.relative_to(package)}:{n}" for path in modules if path.name != "locks.py"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.search(r"threading\.(R?Lock|Condition|Semaphore)\(", line)]
    assert not bare, f"a bare threading lock (use locks.ForkSafeLock): {bare}"
