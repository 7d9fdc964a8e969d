"""The Celery wiring: :func:`install`, the worker step that hooks throttled tasks and
runs the releaser of the lines, and the hooking of tasks itself.

Usually :func:`install` adds :class:`ThrottleStep` to the worker before it is built. Two other orders are covered too, so that a throttled task never runs
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
import os
import weakref
from typing import Any

from billiard.exceptions import WorkerLostError
from celery import bootsteps, signals
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.exceptions import TimeLimitExceeded
from celery.signals import task_failure, task_revoked, worker_init, worker_process_init, worker_shutdown

from ..celery_parts.internals import chain_on_close, processes_idle, wrap_update_strategies
from ..check import slots
from ..check.controller import controller
from ..check.journaling import store_is_broker_db
from ..check.limiter import Throttle
from ..core.config import hide_secrets
from ..core.errors import StoreError
from ..core.header import HEADER, Header
from ..core.spec import declared_spec
from ..core.timing import FAR_WARM_CONNECTIONS, RTT_COUNTS_FROM_US
from ..core.urls import safe_url
from ..waits.releaser import Releaser
from ..waits.why import throttle_why as _why_command  # noqa: F401 - registers the remote control command
from .publish import wrap_send_task
from .screen import ScreenStep, screen_strategies
from .trace import attach

__all__ = ["ThrottleStep", "attach_to_running_workers", "install", "patch_tasks"]

logger = logging.getLogger("celery_throttle")

#: Workers built in this process, to find the ones an install() comes too late for.
_workers: weakref.WeakSet[Any] = weakref.WeakSet()
#: The controllers of the throttle steps built in this process (a prefork child warms
#: their stores' connections as it starts).
_stepped: weakref.WeakSet[Throttle] = weakref.WeakSet()


class ThrottleStep(bootsteps.StartStopStep):
    """Added to ``app.steps['worker']`` by :func:`celery_throttle.install`."""

    label = "celery_throttle"
    #: Started after the pool (its __init__, which hooks the tasks, runs before anything
    #: starts): the prefork pool forks its processes in its start, and a thread of ours
    #: running then (the releaser) could hold a lock the process inherits held, forever.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.releaser: Any = None
        # (The holders of slots a pool process takes name this worker: a slot held by a
        # body whose process is killed is found and given back by this process.)
        slots.WORKER_PID = os.getpid()
        # Runs before the pool forks and before the consumer builds task tracers, so
        # every child sees the hooked classes. A bad rule stops the worker here, loudly.
        self.controller = install(worker.app)
        hooked = patch_tasks(self.controller)
        if not self.controller.settings.enabled:
            logger.warning("celery_throttle: throttle_enabled is False: %d throttled task(s) run "
                           "without any limit", hooked)
        elif hooked:
            # No Redis to use, or a Sentinel URL without its group: a clear error now (the
            # client connects lazily: a Redis that is down is not an error here).
            self.controller.store.connect()
            # (Before the consumer starts, which consumes the queues chosen by then.)
            self.controller.lines.hand.open(worker.app, worker.hostname, self.controller.settings.hand_off)
            _say_what_is_throttled(self.controller)
            _stepped.add(self.controller)
            if not (isinstance(worker.pool_cls, type) and issubclass(worker.pool_cls, PreforkPool)):
                # (Threads or greenlets of this process check: a connection each. A prefork
                # pool's children warm their own as they start: _warm_child.)
                _warm(self.controller, min(int(getattr(worker, "concurrency", 1) or 1), 64) + 1)

    def start(self, worker: Any) -> None:
        hand, consumer = self.controller.lines.hand, getattr(worker, "consumer", None)
        if hand.queue is not None and consumer is not None:
            hand.idle = lambda: processes_idle(consumer) > 0
        self.releaser = _start_releaser(self.controller)
        _hook_at_reload(worker, self.controller)

    def stop(self, worker: Any) -> None:
        if self.releaser is not None:
            self.releaser.stop()
            self.releaser.join(timeout=5)
            self.releaser = None

    shutdown = terminate = stop  # (a cold shutdown terminates steps instead of stopping them)


def _say_what_is_throttled(ctl: Throttle) -> None:
    """One line at start: the throttled tasks, the store and what it risks (each risk
    also on a WARNING line of its own)."""
    store = ctl.store
    names = sorted(name for name, task in ctl.app.tasks.items() if type(task).__dict__.get("_throttle_hooked"))
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    # (Before the pool forks: every child starts with every script made, and knowing how
    # far away the store is and the store's epoch, read before any call of its own:
    # Journaling.epoch.)
    store.make_scripts()
    try:
        rtt_us = store.measure_rtt()
        ctl.lines.journal.prime()
        report = store.report(ctl.lines.journal.enabled)
    except StoreError as exc:
        logger.warning("celery_throttle: throttling %d task(s) (%s); store %s not checked: %s", len(names), shown,
                       safe_url(store.url), exc)
        return
    logger.info("celery_throttle: throttling %d task(s) (%s); store %s: %s, round trip %.1f ms; tasks that "
                "must wait do so in their key's line, in the store%s", len(names), shown, safe_url(store.url),
                report.summary(), rtt_us / 1000, _where_copies_are(ctl))
    for risk in report.risks:
        logger.warning("celery_throttle: the throttle store %s: %s", safe_url(store.url), risk)


def _where_copies_are(ctl: Throttle) -> str:
    """The start line's word on what keeps a waiting task should the store be lost."""
    if ctl.lines.journal.enabled:
        return ", with a copy in the broker's journal"
    if store_is_broker_db(ctl.app, ctl.settings.redis_url):
        return (" (the store is the broker's own Redis database: a waiting task is lost only with the broker's "
                "queues, as plain Celery's queued tasks would be)")
    return " alone (throttle_journal is off: a store restarted empty or evicting loses them)"


def _warm(ctl: Throttle, connections: int) -> None:
    """A store far away: open ``connections`` to it now, and read the controls, so that no
    check of a burst waits for a new connection's handshake or the first read."""
    if ctl.store.rtt_us < RTT_COUNTS_FROM_US:
        return
    try:
        ctl.store.warm(connections)
        ctl.checker.refresh_controls()
    except StoreError as exc:
        logger.warning("celery_throttle: could not open connections to the store ahead: %s", exc)


@worker_process_init.connect(weak=False)
def _warm_child(**_: Any) -> None:
    """A prefork pool process starts: warm its own connections (a fork keeps none)."""
    for ctl in list(_stepped):
        _warm(ctl, FAR_WARM_CONNECTIONS)


def _start_releaser(ctl: Any) -> Any:
    releaser = Releaser(ctl.setup, ctl.checker, ctl.lines)
    releaser.start()
    return releaser


def _hook_at_reload(worker: Any, ctl: Any) -> None:
    """Hook the tasks defined since the worker started when it reloads them."""
    consumer = getattr(worker, "consumer", None)
    if consumer is None or getattr(consumer, "_throttle_reload_hooked", False):
        return

    def hook_and_screen() -> None:
        patch_tasks(ctl)
        screen_strategies(ctl, consumer)

    wrap_update_strategies(consumer, hook_and_screen)
    consumer._throttle_reload_hooked = True


def attach_to_running_workers(ctl: Any) -> None:
    """``install()`` came after a worker of this app was built: do what the step does."""
    for worker in list(_workers):
        if worker.app is not ctl.app or getattr(worker, "blueprint", None) is None:
            continue  # not built yet: the step just added to app.steps will be in it
        if any(isinstance(step, ThrottleStep) for step in getattr(worker, "steps", ())):
            continue
        hooked = patch_tasks(ctl)
        logger.warning("celery_throttle: installed on a worker that was already built; hooked %d "
                       "throttled task(s) and started the releaser", hooked)
        _stop_with(worker, _start_releaser(ctl))
        _hook_at_reload(worker, ctl)


def _stop_with(worker: Any, releaser: Any) -> None:
    """Stop ``releaser`` when ``worker`` stops, warm or cold (a cold stop sends no
    worker_shutdown, but always closes the blueprint)."""

    def stop() -> None:
        releaser.stop()
        releaser.join(timeout=5)

    chain_on_close(worker, stop)


@worker_init.connect(weak=False)
def _on_worker_init(sender: Any, **_: Any) -> None:
    _workers.add(sender)
    _install_if_forgotten(sender.app)


def _install_if_forgotten(app: Any) -> None:
    if app.__dict__.get(_WIRED):
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
    _workers.discard(sender)


@task_failure.connect(weak=False)
def _on_task_failure(sender: Any = None, task_id: str | None = None, exception: Any = None, args: Any = None,
                     kwargs: Any = None, **_: Any) -> None:
    # (Sent by the worker's main process when a pool process was killed by a hard time
    # limit, or died: the body's own process cannot give its slot back.)
    if isinstance(exception, (TimeLimitExceeded, WorkerLostError)) and task_id:
        _give_back_for(sender, task_id, args, kwargs)


@task_revoked.connect(weak=False)
def _on_task_revoked(sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False,
                     **_: Any) -> None:
    if request is None:
        return
    if terminated:
        _give_back_for(sender, request.id, getattr(request, "args", ()), getattr(request, "kwargs", {}))
    else:
        # Discarded before it started (expired, or revoked), a task released from its line
        # will not use its room: given back, for the next of its line.
        _give_back_ticket(sender, request)


def _give_back_for(task: Any, task_id: str, args: Any, kwargs: Any) -> None:
    """Give back the concurrency slots a task held in a pool process that was killed."""
    if getattr(type(task), "_throttle_spec", None) is None if task is not None else True:
        return
    try:
        controller(task.app).slots.release_killed(task, task_id, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - its lease runs out, and the slot is reclaimed
        logger.warning("could not give back the concurrency slot of %s[%s], whose process was killed: %r; "
                       "it is reclaimed when its lease runs out", task.name, task_id, exc)


def _give_back_ticket(task: Any, request: Any) -> None:
    """A task released from its line was discarded before it started: its room goes back."""
    if task is None or getattr(type(task), "_throttle_spec", None) is None:
        return
    headers = getattr(request, "headers", None)
    header = Header.read((headers.get(HEADER) if isinstance(headers, dict) else None)
                         or getattr(request, HEADER, None))
    if not header.ticket:
        return
    try:
        ctl = controller(task.app)
        call = ctl.checker.bind(task, getattr(request, "args", ()) or (), getattr(request, "kwargs", {}) or {})
        if call.state_key == header.key:
            ctl.lines.handle(call, ctl.checker.give_back(call, header.ticket))
    except Exception as exc:  # noqa: BLE001 - its time out runs out, and its room comes back then
        logger.warning("could not give back the room of %s[%s], discarded before it started: %r", task.name,
                       request.id, exc)


_WIRED = "_celery_throttle_wired"


def install(app: Any, **overrides: Any) -> Throttle:
    """Wire celery_throttle into ``app`` and return its :class:`Throttle` controller.

    Idempotent and safe at import time of the app module: settings (``throttle_*`` in
    ``app.conf``, ``overrides`` without the prefix win) are read on first use. Adds a
    worker bootstep that hooks every throttled task (``@throttle`` or
    ``throttle_rules``) before the pool starts, and releases the lines.
    """
    ctl = controller(app)
    if overrides:
        ctl.configure(overrides)  # bad overrides fail here, at the call site
    if not app.__dict__.get(_WIRED):
        setattr(app, _WIRED, True)
        app.steps["worker"].add(ThrottleStep)
        app.steps["consumer"].add(ScreenStep)
        wrap_send_task(ctl)  # admission at publish: needs no finalized app, nor hooked tasks
        app.on_after_finalize.connect(_patch_on_finalize, weak=False)
        if app.finalized:
            patch_tasks(ctl)  # (the signal has fired already: tasks are hooked now)
        # The store's password out of app.conf, whether or not a worker ever reads the
        # settings (`celery report` does not): when the configuration loads, and before
        # any celery command imports the task modules (a URL set after the load).
        app.on_after_configure.connect(_hide_secrets, weak=False)
        signals.import_modules.connect(_hide_secrets, sender=app, weak=False)
        if app.configured:
            hide_secrets(app)
        attach_to_running_workers(ctl)
    return ctl


def _patch_on_finalize(sender: Any, **_: Any) -> None:
    patch_tasks(controller(sender))


def _hide_secrets(sender: Any, **_: Any) -> None:
    hide_secrets(sender)


def patch_tasks(ctl: Throttle) -> int:
    """Hook every throttled task of the app (decorated or matched by a rule)."""
    count = 0
    for name, task in list(ctl.app.tasks.items()):
        if name.startswith("celery."):
            continue
        spec, where = declared_spec(task), f"task {name}"
        if spec is None:
            spec = ctl.checker.rule_for(name)
            where = f"throttle_rules[{ctl.checker.rule_pattern(name)!r}] for task {name}"
        if spec is not None:
            spec.check_signature(task.run, where)
            attach(task, spec)
            count += 1
    return count
