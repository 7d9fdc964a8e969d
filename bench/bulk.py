"""Pipelining celery_throttle's window script, for bulk fills and the 10-key cost run.

celery_throttle has no public batch API. :class:`Bulk` borrows the store's own argument
building: inside ``with Bulk(store):`` each ``store.acquire(...)`` (so each
``ctl.acquire(...)``) queues its script call in a pipeline instead of sending it, and gets
a placeholder "allowed" reply. This leans on two internals, ``RedisStore._run`` and
``RedisStore._scripts``; :func:`supported` says whether they are still there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_throttle.core.protocol import WindowReply


def _placeholder() -> list[int]:
    """What a queued call answers: code 1 (allowed), then zeros for WindowReply's other fields."""
    return [1] + [0] * (len(WindowReply._fields) - 1)


def supported(store: Any) -> bool:
    """True when ``store`` still has the internals :class:`Bulk` uses."""
    try:
        store.client  # connects and registers the scripts
    except Exception:
        return False
    return callable(getattr(type(store), "_run", None)) and isinstance(getattr(store, "_scripts", None), dict)


class Bulk:
    """Queue the store's script calls into pipelines of ``batch`` calls."""

    def __init__(self, store: Any, batch: int = 500) -> None:
        self.store = store
        self.batch = batch
        self.sent = 0
        self._pipe: Any = None
        self._queued = 0

    def __enter__(self) -> Bulk:
        client = self.store.client
        # Loaded up front (once per store), so the pipeline can send EVALSHA as directly
        # as the store does.
        if not getattr(self.store, "_bulk_scripts_loaded", False):
            for script in self.store._scripts.values():
                client.script_load(script.script)
            self.store._bulk_scripts_loaded = True
        self._pipe = client.pipeline(transaction=False)
        self.store._run = self._queue  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            del self.store._run
        finally:
            if exc[0] is None:
                self.flush()

    def _queue(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> list[int]:
        self._pipe.evalsha(self.store._scripts[script].sha, len(keys), *keys, *args)
        self._queued += 1
        if self._queued >= self.batch:
            self.flush()
        return _placeholder()

    def flush(self) -> list[Any]:
        """Send what is queued; returns the raw replies."""
        if not self._queued:
            return []
        replies = self._pipe.execute()
        self.sent += self._queued
        self._queued = 0
        return replies
