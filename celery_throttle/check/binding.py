"""A task's throttle bound to one call's arguments, under the live limits and pauses this
process has read: the rules, the throttle an app knows for a task name, the live limit in
place of a declared rate (keeping its state), each sliding window widened by its margin."""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import replace
from functools import lru_cache
from typing import Any, NamedTuple, Protocol

from ..celery_parts.internals import registered_task
from ..core import timing
from ..core.adapt import Adapt
from ..core.config import Settings
from ..core.cost import rate_costs
from ..core.rates import Rate
from ..core.spec import BoundCall, ThrottleSpec, declared_spec
from ..core.state import rate_field
from ..store.client import RedisStore
from .controls import Controls

__all__ = ["Binder", "Known", "Stores"]


class Stores(Protocol):
    """What a checker works with: the settings, and the store by two connections."""

    @property
    def settings(self) -> Settings: ...

    @property
    def store(self) -> RedisStore: ...

    @property
    def quick_store(self) -> RedisStore: ...


class Binder:
    """The binding of one app's throttled calls, in this process."""

    def __init__(self, owner: Stores) -> None:
        self._owner = owner
        #: This process's copy of the pauses and live limits.
        self.controls = Controls()
        self._rules: list[tuple[str, ThrottleSpec]] | None = None

    def forget(self) -> None:
        """Forget what was read of the settings (they changed)."""
        self._rules = None

    @property
    def settings(self) -> Settings:
        return self._owner.settings

    @property
    def store(self) -> RedisStore:
        return self._owner.store

    @property
    def quick_store(self) -> RedisStore:
        return self._owner.quick_store

    def max_wait(self, spec: ThrottleSpec) -> float | None:
        """The longest a denied call of ``spec`` may wait (seconds), or None."""
        return spec.max_wait if spec.max_wait is not None else self.settings.max_wait

    def max_wait_us(self, spec: ThrottleSpec) -> int:
        """:meth:`max_wait` in µs, as a line's entry carries it (0: no cap)."""
        max_wait = self.max_wait(spec)
        return int(max_wait * 1_000_000) if max_wait else 0

    def rule_for(self, task_name: str) -> ThrottleSpec | None:
        """The first ``throttle_rules`` entry whose glob matches ``task_name``."""
        if self._rules is None:
            self._rules = [
                (pattern, ThrottleSpec.from_rule(pattern, options))
                for pattern, options in self.settings.rules.items()
            ]
        for pattern, spec in self._rules:
            if fnmatch.fnmatchcase(task_name, pattern):
                return spec
        return None

    def known(self, app: Any, name: str, task: Any) -> Known | None:
        """The throttle ``app`` knows for task ``name`` (``task``: its task, if the caller
        has it): a ``@throttle`` on its task, else a rule; None if it has none."""
        if task is None:
            task = registered_task(app, name)
        spec = declared_spec(task) if task is not None else None
        if spec is None:
            spec = self.rule_for(name) if not name.startswith("celery.") else None
        if spec is None:
            return None
        return Known(spec, _call_signature(task) if task is not None else None, task)

    def rule_pattern(self, task_name: str) -> str | None:
        """The glob of the first rule matching ``task_name``, or None."""
        return next((p for p in self.settings.rules if fnmatch.fnmatchcase(task_name, p)), None)

    def bind(self, task: Any, args: Any, kwargs: Any, *, quick: bool = False) -> BoundCall:
        """The limit of one call of a hooked task: its throttle bound to the arguments,
        under the live limit of its scope or key if one is set."""
        return self.bind_spec(task.name, type(task)._throttle_spec, type(task)._throttle_signature,
                              args, kwargs, quick=quick)

    def bind_spec(self, name: str, spec: ThrottleSpec, signature: inspect.Signature | None, args: Any,
                  kwargs: Any, *, quick: bool = False) -> BoundCall:
        """As :meth:`bind`, for task ``name`` throttled by ``spec``, whose arguments bind
        to ``signature`` (None: unknown, a key is built from keyword arguments only)."""
        settings = self.settings
        declared = spec.bind(name, signature, args or (), kwargs or {}, settings.default_algorithm,
                             settings.key_prefix)
        call = self.finish_bind(declared, spec.margin, quick=quick, adapt=spec.adapt)
        store = self.quick_store if quick else self.store
        mode = self.controls.mode_for(store, call.scope, call.key) or spec.mode or settings.mode
        return replace(call, shadow=True) if mode == "shadow" else call

    def finish_bind(self, declared: BoundCall, margin: float | None, *, quick: bool = False,
                    adapt: Adapt | None = None) -> BoundCall:
        """A call bound as declared, under the live limits (an ``adapt`` throttle's at the
        share of them its key is at: window.lua scales them), each sliding window widened by
        ``margin`` (None: ``throttle_margin``): a task's call and a direct ``acquire`` of the
        same scope and rates count in the same fields."""
        call = self.live(declared, quick=quick)
        if adapt is not None and call.rates:
            call = replace(call, adapt=adapt)
        margin = margin if margin is not None else self.settings.margin
        if call.algorithm == "sliding" and margin != 0:
            margin_us = -1 if margin is None else round(margin * 1_000_000)  # -1: the default, per rate
            rates = _widened(call.rates, margin_us)
            # (A live rate keeps the state of the declared one of its window and unit, both
            # widened alike.)
            fields = None if call.fields is None else _live_fields(call.algorithm, _widened(declared.rates, margin_us),
                                                                   rates)
            call = replace(call, rates=rates, fields=fields)
        return call

    def live(self, call: BoundCall, *, quick: bool = False) -> BoundCall:
        """``call`` under the live limit of its key, else of its scope, if one is set (rates,
        concurrency, or both).

        A live rate of the same window length as a declared one takes its place and keeps
        its state (what was counted and reserved still counts, under the new limit); a
        window of another length starts empty; a declared rate of a window the live limit
        does not set stays in force, unless it replaces them all (:func:`.controls.merged_rates`)."""
        store = self.quick_store if quick else self.store
        concurrency = self.controls.concurrency_for(store, call.scope, None if call.share else call.key)
        if concurrency is not None and concurrency != call.concurrency:
            call = replace(call, concurrency=concurrency)
        override = self.controls.rates_for(store, call.scope, call.key, call.rates)
        if override == call.rates:
            return call
        cost = rate_costs(override, call.unit_costs) if call.unit_costs else call.cost
        return replace(call, rates=override, cost=cost, fields=_live_fields(call.algorithm, call.rates, override))

    def with_live_concurrency(self, call: BoundCall) -> BoundCall:
        """``call`` under the concurrency limit in force now (a live K set or cleared since
        it was bound; a shared K is the scope's)."""
        live = self.controls.concurrency_for(self.store, call.scope, None if call.share else call.key)
        concurrency = call.declared_concurrency if live is None else live
        return call if concurrency == call.concurrency else replace(call, concurrency=concurrency)


class Known(NamedTuple):
    """The throttle an app knows for a task name."""

    spec: ThrottleSpec
    #: What its arguments bind to (None: this process does not have the task).
    signature: inspect.Signature | None
    #: The task, or None.
    task: Any


def _call_signature(task: Any) -> inspect.Signature | None:
    """What the arguments of a call of ``task`` bind to: its ``run`` as the task calls it
    (for ``bind=True``, without ``self``), once per task class."""
    cls = type(task)
    if "_throttle_call_signature" not in cls.__dict__:
        try:
            cls._throttle_call_signature = inspect.signature(task.run)
        except (TypeError, ValueError):
            cls._throttle_call_signature = None
    signature: inspect.Signature | None = cls._throttle_call_signature
    return signature


@lru_cache(maxsize=1024)
def _widened(rates: tuple[Rate, ...], margin_us: int) -> tuple[Rate, ...]:
    """Each rate's window made ``margin_us`` longer (a window of its own in the state);
    -1: by the default margin of its length (:func:`.timing.default_margin_us`)."""
    return tuple(Rate(r.limit, (r.period_us + (margin_us if margin_us >= 0 else timing.default_margin_us(r.period_us)))
                      / 1_000_000, r.unit) for r in rates)


@lru_cache(maxsize=1024)
def _live_fields(algorithm: str, declared: tuple[Rate, ...], live: tuple[Rate, ...]) -> tuple[str, ...]:
    """The state field of each live rate: the declared rate's of the same window length
    and unit, else its own."""
    by_period = {(r.period_us, r.unit): r for r in declared}
    return tuple(rate_field(algorithm, by_period.get((r.period_us, r.unit), r)) for r in live)
