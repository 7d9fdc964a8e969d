"""The worker bootstep: hooks throttled tasks and runs the parked-task releaser."""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

__all__ = ["ThrottleStep"]

logger = logging.getLogger("celery_throttle")


class ThrottleStep(bootsteps.StartStopStep):
    """Added to ``app.steps['worker']`` by :func:`celery_throttle.install`."""

    label = "celery_throttle"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        from . import install

        super().__init__(worker, **kwargs)
        self.releaser = None
        # Runs before the pool forks and before the consumer builds task tracers, so
        # every child sees the hooked classes. A bad rule stops the worker here, loudly.
        self.controller = install(worker.app)
        hooked = self.controller.patch_tasks()
        if not self.controller.settings.enabled:
            logger.warning("celery_throttle: throttle_enabled is False: %d throttled task(s) run "
                           "without any limit", hooked)
        elif hooked:
            _ = self.controller.store  # no Redis to use: a clear error now, not a silent default

    def start(self, worker: Any) -> None:
        from .parking import Releaser

        self.releaser = Releaser(self.controller)
        self.releaser.start()

    def stop(self, worker: Any) -> None:
        if self.releaser is not None:
            self.releaser.stop()
            self.releaser.join(timeout=5)
            self.releaser = None

    shutdown = stop
