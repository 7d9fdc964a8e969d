"""The Throttle controller: the limiter as users and operators call it (``acquire``, ``status``
(read in :mod:`.status`), ``pause``, ``set_limit``, ...), over the app's parts in this process
(:class:`.setup.Setup`: the settings, the store connections and the counters; and the parts
it wires, each given the parts it works with: the checks, the lines, the slots, the hints
at publish and the record)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core.config import Settings, check_mode
from ..core.cost import check_positive
from ..core.errors import ConfigurationError
from ..core.keys import state_key
from ..core.rates import Rate
from ..core.spec import BoundCall, ThrottleSpec, direct_call
from ..core.state import FOREVER_US
from ..store.client import RedisStore
from .checker import Checker
from .control_fields import (
    ControlSet,
    limit_field,
    mode_field,
    parse_controls,
    pause_field,
)
from .hints import Hints
from .lines import Lines
from .metrics import Metrics
from .recorder import Recorder
from .setup import Setup
from .slots import Slots
from .status import (
    Decision,
    Status,
    decision,
    declared_rates,
    find_targets,
    known_specs,
    paused_until,
    read_status,
    unix,
)

__all__ = ["Throttle"]

logger = logging.getLogger("celery_throttle")


class Throttle:
    """Global limits for one Celery app. Get it from :func:`celery_throttle.install`.

    The API users and operators call. It holds the app's parts in this process, wired here
    and only here, each given what it works with: the :class:`.setup.Setup` (settings,
    store connections, counters) and the other parts it calls. The hook, the screen,
    publish and the waits take the parts they need from it."""

    def __init__(self, app: Any, overrides: Mapping[str, Any] | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        self.setup = setup = Setup(app, overrides, clock)
        #: The checks of this app's calls (the hook, the screen and publish use them).
        self.checker = checker = Checker(setup)
        #: This process's side of the lines, and of the concurrency slots.
        self.lines = lines = Lines(setup, checker)
        self.slots = Slots(setup, checker, lines)
        #: What this process may send unchecked at publish (see :mod:`..integration.publish`).
        self.hints = Hints()
        #: What this process saw, for ``throttle simulate`` (``throttle_record``).
        self.recorder = Recorder(setup)

    @property
    def app(self) -> Any:
        return self.setup.app

    @property
    def settings(self) -> Settings:
        """The settings, read from ``app.conf`` on first use."""
        return self.setup.settings

    @property
    def store(self) -> RedisStore:
        """The Redis store, connected on first use (in the process that uses it)."""
        return self.setup.store

    @property
    def quick_store(self) -> RedisStore:
        return self.setup.quick_store

    @property
    def metrics(self) -> Metrics:
        return self.setup.metrics

    def configure(self, overrides: Mapping[str, Any]) -> None:
        """Apply more overrides (``install`` called again with settings)."""
        self.setup.configure(overrides)
        self.checker.forget()  # (what was read under the settings before is read again)

    def close(self) -> None:
        """Close the connections to the store (a later call opens new ones)."""
        self.setup.close()

    def acquire(
        self,
        scope: str,
        key: str | None = None,
        rates: str | Sequence[str] = (),
        cost: int | Mapping[str, int] = 1,
        algorithm: str | None = None,
    ) -> Decision:
        """Consume ``cost`` units of ``scope`` (and ``key``) now if every rate admits it;
        for rates of named units, a cost by unit: ``cost={"tokens": 1200}`` (a unit not
        named: 1).

        A denial consumes nothing. ``retry_after`` says when the same call would fit. It
        shares the count of the tasks that name the same scope, key and rates (with the
        same margin: ``throttle_margin``, or 2% of each sliding window, at most 20 ms), and
        waits its turn behind the tasks in their line: it is not admitted while any wait.
        """
        call = self.checker.finish_bind(self._direct_call(scope, key, rates, cost, algorithm), None)
        return decision(call, self.checker.acquire(call))

    def status(self, scope: str, key: str | None = None) -> Status:
        """Usage of every rate stored for ``scope``/``key``, consuming nothing."""
        return self._status(scope, key, parse_controls(self.store.controls()), self._known_specs())

    def statuses(self, match: str = "*", limit: int = 200, scope: str | None = None,
                 key_match: str | None = None) -> tuple[list[Status], bool]:
        """The status of every scope and key that Redis holds a window, a pause or a live
        limit for, whose scope matches the glob ``match`` and key the glob ``key_match``
        (:func:`.keys.target_matches`; and, if given, whose scope is ``scope``); found by
        SCAN, never KEYS. At most ``limit`` of them; the flag is True if more were left."""
        controls = parse_controls(self.store.controls())
        ordered, more = find_targets(self.store, self.settings.key_prefix, controls, match, limit, scope, key_match)
        specs = self._known_specs()  # (once for every status listed)
        return [self._status(scope, key, controls, specs) for scope, key in ordered], more

    def known_scopes(self) -> list[str]:
        """The scopes this app's throttled tasks use (declared or by rule; a scope that
        is the task's name where none is given)."""
        return sorted({scope for scope, _ in self._known_specs()})

    def _known_specs(self) -> list[tuple[str, ThrottleSpec]]:
        return known_specs(self.app, self.checker.rule_for)

    def _status(self, scope: str, key: str | None, controls: ControlSet, specs: list[tuple[str, ThrottleSpec]]) -> Status:
        return read_status(self.store, self.settings.key_prefix, self.settings.margin, specs, controls, scope, key,
                           self.settings.mode)

    def pause(self, scope: str, key: str | None = None, seconds: float | None = None) -> float:
        """Start nothing of ``scope`` (or of its ``key``) for ``seconds`` (None: until
        :meth:`resume`), on every worker within CONTROL_REFRESH. Tasks that arrive wait in
        their key's line, never failed by it; the line's head goes when the pause is over.
        A longer pause already set stays. Returns when it ends (Unix time; ``inf``: never)."""
        self._direct_call(scope, key, "1/s", 1, None)  # (validates scope and key)
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not 0 < seconds < 10 * 365 * 86400):
            raise ConfigurationError(f"pause seconds must be a positive number (or None: until resumed), "
                                     f"got {seconds!r}")
        field = pause_field(scope, key)
        until = self.store.pause(field, seconds)
        self.checker.controls.note(field, str(until))
        logger.warning("paused scope %r%s %s", scope, "" if key is None else f" key {key!r}",
                       "until resumed" if until == FOREVER_US else f"for {seconds:.1f}s")
        return unix(until)

    def resume(self, scope: str, key: str | None = None) -> bool:
        """End a pause of ``scope`` (or of its ``key``) now. True if there was one.

        Every line the pause held (of this scope, or key) gets a look at once: a worker's
        releaser is woken, and sends their heads as their keys have room (the workers send
        them, with their own app's routing, not this process)."""
        self._direct_call(scope, key, "1/s", 1, None)
        field = pause_field(scope, key)
        self.checker.controls.note(field, None)
        found = self.store.clear_control(field)
        if found:
            woken = self.lines.wake(scope, key)
            logger.warning("resumed scope %r%s: %d line(s) it held get a look now", scope,
                           "" if key is None else f" key {key!r}", woken)
        return found

    def set_limit(self, scope: str, rates: str | Sequence[str] | None = None, key: str | None = None, *,
                  concurrency: int | None = None, replace: bool = False) -> tuple[Rate, ...]:
        """Limit ``scope`` (every key of it that has no limit of its own, or only ``key``)
        to ``rates``, and (``concurrency``) to K bodies running at once, instead of what
        the code declares, on every worker within CONTROL_REFRESH, until
        :meth:`clear_limit`. A live rate takes the place of the declared rate of its window
        length and unit; the declared rates of other windows stay in force beside it (a
        live ``2/s`` on ``10/s, 5000/h``: ``2/s, 5000/h``), unless ``replace`` (then the
        live rates alone are in force; :meth:`rates_in_force` says which are). The tasks waiting in the lines of the scope (or key) get a look
        at once: a raised limit lets them go now. A lowered one holds back the heads of the
        lines, and a task released under the old limit that finds no room when it arrives
        goes back to its place; a lowered K lets the bodies running end, and starts no more
        until fewer than K run. Returns the rates set (empty with ``concurrency`` alone)."""
        if rates is None and concurrency is None:
            raise ConfigurationError("set_limit takes rates, a concurrency, or both")
        if replace and rates is None:
            raise ConfigurationError("set_limit(replace=True) replaces the declared rates: give the rates")
        if concurrency is not None:
            check_positive(concurrency, "concurrency")
        parsed = self._direct_call(scope, key, "1/s" if rates is None else rates, 1, None).rates
        target = _target(scope, key)
        if rates is not None:
            value = self.checker.controls.write_limit(self.store, scope, key, parsed, replace)
            logger.warning("live limit of %s set to %s%s", target, value,
                           " in place of every declared rate" if replace else "")
        if concurrency is not None:
            self.checker.controls.write_concurrency(self.store, scope, key, concurrency)
            logger.warning("live concurrency limit of %s set to %d", target, concurrency)
        self.lines.wake(scope, key)
        return parsed if rates is not None else ()

    def clear_limit(self, scope: str, key: str | None = None) -> bool:
        """Back to the rates and the concurrency in the code for ``scope`` (or ``key``).
        True if a live limit was set."""
        self._direct_call(scope, key, "1/s", 1, None)
        found = self.checker.controls.clear_limits(self.store, scope, key)
        self.lines.wake(scope, key)  # (the code's limits may be higher: tasks waiting go now)
        return found

    def set_mode(self, mode: str, scope: str | None = None, key: str | None = None) -> None:
        """Put the throttles of ``scope`` (or its ``key``; no scope: every throttle of the
        app) in ``mode`` on every worker within CONTROL_REFRESH, in place of the code's
        ``mode=`` and ``throttle_mode``, until :meth:`clear_mode`: ``"shadow"`` counts and
        reports what they would hold back and holds nothing (the tasks waiting in their
        lines go at once); ``"enforce"`` holds again. A key's mode goes before its scope's,
        a scope's before the app's."""
        check_mode(mode, "mode")
        self._mode_target(scope, key)
        self.checker.controls.write_mode(self.store, scope, key, mode)
        logger.warning("%s now in %s mode", _target(scope, key), mode)
        if mode == "shadow":
            self.lines.wake(scope, key)

    def clear_mode(self, scope: str | None = None, key: str | None = None) -> bool:
        """Back to the mode the code and ``throttle_mode`` say for ``scope``/``key`` (no
        scope: the app's live mode). True if a live mode was set."""
        self._mode_target(scope, key)
        found = self.checker.controls.write_mode(self.store, scope, key, None)
        self.lines.wake(scope, key)  # (back to shadow mode, perhaps: whatever waits goes)
        return found

    def live_mode(self, scope: str | None = None, key: str | None = None) -> str | None:
        """The live mode set for exactly ``scope``/``key`` (no scope: the app's; read
        now), or None."""
        return parse_controls(self.store.controls()).modes.get(mode_field(scope, key))

    def _mode_target(self, scope: str | None, key: str | None) -> None:
        if scope is None:
            if key is not None:
                raise ConfigurationError("a key's mode needs its scope")
        else:
            self._direct_call(scope, key, "1/s", 1, None)  # (validates scope and key)

    def declared_rates(self, scope: str) -> tuple[tuple[Rate, ...], bool]:
        """The rates this app's tasks of ``scope`` declare (by decorator or rule), and
        whether one of them declares its rates by a callable (known only per call)."""
        return declared_rates(self._known_specs(), scope)

    def rates_in_force(self, scope: str, key: str | None = None) -> tuple[Rate, ...]:
        """The rates in force for the calls of ``scope``/``key`` that declare
        :meth:`declared_rates` (read now): those, under the live limit if one is set
        (:func:`.controls.merged_rates`)."""
        return parse_controls(self.store.controls()).rates_of(scope, key, self.declared_rates(scope)[0])

    def live_limit(self, scope: str, key: str | None = None) -> tuple[Rate, ...] | None:
        """The live limit set for exactly ``scope``/``key`` (read now), or None."""
        return parse_controls(self.store.controls()).limits.get(limit_field(scope, key))

    def paused_until(self, scope: str, key: str | None = None) -> float | None:
        """When the pause covering ``scope``/``key`` ends (Unix time), or None."""
        return paused_until(self.store, parse_controls(self.store.controls()), scope, key)

    def live_concurrency(self, scope: str, key: str | None) -> int | None:
        """The live concurrency limit of ``scope``/``key`` as this process last read the
        controls (within CONTROL_REFRESH), or None."""
        return self.checker.controls.concurrency_for(self.store, scope, key)

    def reset(self, scope: str, key: str | None = None) -> bool:
        """Forget every window of ``scope``/``key`` (its line stays: its tasks get a look at
        once, with the room the reset gave). True if there was anything."""
        found = self.store.delete(state_key(self.settings.key_prefix, scope, key)) > 0
        self.lines.wake(scope, key)
        return found

    def reset_keys(self, scope: str) -> list[str | None]:
        """Forget the windows of ``scope`` and of every key of it (found by SCAN, as
        :meth:`statuses` finds them). Returns the keys reset (None: the scope's own)."""
        done: list[str | None] = []
        while True:
            found, more = self.statuses(scope=scope, limit=1000)
            fresh = [st.key for st in found if st.key not in done and st.rates]
            for key in fresh:
                self.reset(scope, key)
                done.append(key)
            if not more or not fresh:
                return done

    def _direct_call(self, scope: str, key: str | None, rates: Any, cost: int | Mapping[str, int],
                     algorithm: str | None) -> BoundCall:
        s = self.settings
        return direct_call(s.key_prefix, s.default_algorithm, scope, key, rates, cost, algorithm)


def _target(scope: str | None, key: str | None) -> str:
    if scope is None:
        return "every throttle of the app"
    return f"scope {scope!r}" + ("" if key is None else f" key {key!r}")
