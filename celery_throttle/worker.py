"""The worker side of the wiring: hooks throttled tasks and runs the parked-task releaser.

Usually :func:`celery_throttle.install` adds :class:`ThrottleStep` to the worker before
it is built. Two other orders are covered too, so that a throttled task never runs
unthrottled without a word:

- ``install()`` never called: when a worker of an app with throttled tasks (or
  ``throttle_rules``) starts, it is installed then, with a warning saying to call it.
- ``install()`` called after a worker of the app was built (an in-process test worker,
  then ``install``): the tasks are hooked and a releaser is started for that worker.

In both, a task defined after the worker started (then ``worker.reload()``, Celery's own
test pattern) is hooked at that reload.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from celery import bootsteps
from celery.signals import worker_init, worker_shutdown

__all__ = ["ThrottleStep", "attach_to_running_workers"]

logger = logging.getLogger("celery_throttle")

#: Workers built in this process, to find the ones an install() comes too late for.
_workers: weakref.WeakSet[Any] = weakref.WeakSet()


class ThrottleStep(bootsteps.StartStopStep):
    """Added to ``app.steps['worker']`` by :func:`celery_throttle.install`."""

    label = "celery_throttle"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        from . import install

        super().__init__(worker, **kwargs)
        self.releaser: Any = None
        # Runs before the pool forks and before the consumer builds task tracers, so
        # every child sees the hooked classes. A bad rule stops the worker here, loudly.
        self.controller = install(worker.app)
        hooked = self.controller.patch_tasks()
        if not self.controller.settings.enabled:
            logger.warning("celery_throttle: throttle_enabled is False: %d throttled task(s) run "
                           "without any limit", hooked)
        elif hooked:
            # No Redis to use, or a Sentinel URL without its group: a clear error now (the
            # client connects lazily: a Redis that is down is not an error here).
            _ = self.controller.store.client

    def start(self, worker: Any) -> None:
        self.releaser = _start_releaser(self.controller)
        _hook_at_reload(worker, self.controller)

    def stop(self, worker: Any) -> None:
        if self.releaser is not None:
            self.releaser.stop()
            self.releaser.join(timeout=5)
            self.releaser = None

    shutdown = stop


def _start_releaser(ctl: Any) -> Any:
    from .parking import Releaser

    releaser = Releaser(ctl)
    releaser.start()
    return releaser


def _hook_at_reload(worker: Any, ctl: Any) -> None:
    """Hook the tasks defined since the worker started when it reloads them."""
    consumer = getattr(worker, "consumer", None)
    if consumer is None or getattr(consumer, "_throttle_reload_hooked", False):
        return
    update_strategies = consumer.update_strategies

    def updated() -> None:
        update_strategies()
        ctl.patch_tasks()
        from .screen import screen_strategies

        screen_strategies(ctl, consumer)

    consumer.update_strategies = updated
    consumer._throttle_reload_hooked = True


def attach_to_running_workers(ctl: Any) -> None:
    """``install()`` came after a worker of this app was built: do what the step does."""
    for worker in list(_workers):
        if worker.app is not ctl.app or getattr(worker, "blueprint", None) is None:
            continue  # not built yet: the step just added to app.steps will be in it
        if any(isinstance(step, ThrottleStep) for step in getattr(worker, "steps", ())):
            continue
        hooked = ctl.patch_tasks()
        logger.warning("celery_throttle: installed on a worker that was already built; hooked %d "
                       "throttled task(s) and started the releaser", hooked)
        worker._throttle_releaser = _start_releaser(ctl)
        _hook_at_reload(worker, ctl)


@worker_init.connect(weak=False)
def _on_worker_init(sender: Any, **_: Any) -> None:
    _workers.add(sender)
    _install_if_forgotten(sender.app)


def _install_if_forgotten(app: Any) -> None:
    from . import install
    from .spec import declared_spec

    if "_celery_throttle" in app.__dict__:
        return
    throttled = sorted(name for name, task in app.tasks.items() if declared_spec(task) is not None)
    if not throttled and not app.conf.get("throttle_rules"):
        return
    logger.warning("celery_throttle: celery_throttle.install(app) was never called for app %r; "
                   "installing it at worker start for %s. Call it where the app is created, so "
                   "that producers check at publish and settings are read early.",
                   app.main, ", ".join(throttled) or "throttle_rules")
    install(app)


@worker_shutdown.connect(weak=False)
def _on_worker_shutdown(sender: Any, **_: Any) -> None:
    releaser = getattr(sender, "_throttle_releaser", None)
    if releaser is not None:
        releaser.stop()
        releaser.join(timeout=5)
        sender._throttle_releaser = None
    _workers.discard(sender)
