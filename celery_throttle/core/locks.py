"""Locks that a forked child gets free.

A prefork pool forks its processes from the worker's main process, where threads of ours
run (the releaser, slot renewals, control reads). A fork copies a lock as
it is: one that another thread held at that instant stays held in the child for ever,
and the child's first check, metric or give-back that takes it waits for ever. Every lock
of the package is a :class:`ForkSafeLock`: each is replaced by a fresh one in the child,
right after the fork (``os.register_at_fork``), before the child runs anything else. What
the lock guarded is left as the fork found it: the tables it guards hold single dict and
integer operations, each whole under the GIL.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A ``threading.Lock`` (a green one where gevent or eventlet patched threading),
    fresh and free in the child of a fork."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _everyone.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()

    def _renew(self) -> None:
        self._lock = threading.Lock()


#: Every lock of this process, for the child of a fork to renew.
_everyone: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_in_child() -> None:
    for lock in list(_everyone):
        lock._renew()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_in_child)
