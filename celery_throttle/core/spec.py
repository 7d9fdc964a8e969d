"""What a throttle declares (rates, key, scope, cost, algorithm) and how one call binds it.

Everything that can be checked without the call's arguments is checked when the throttle
is declared, so a mistake fails at import time, not in the worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .adapt import Adapt, adapt_of
from .config import ALGORITHMS, check_margin, check_max_wait, check_mode
from .cost import CostArg, check_positive, declared_cost, direct_cost, never_fits, rate_costs
from .errors import ConfigurationError, KeyBuildError
from .keys import format_key, state_key, template_fields
from .priority import check_urgency
from .protocol import Cost
from .rates import Rate, parse_rates
from .share import Share, check_weight, share_of

__all__ = ["RULE_OPTIONS", "BoundCall", "ThrottleSpec", "declared_spec", "direct_call"]

RateArg = str | Rate | Sequence[str | Rate] | Callable[..., Any]
RULE_OPTIONS = ("rate", "key", "scope", "cost", "algorithm", "max_wait", "margin", "concurrency", "cost_after", "adapt",
                "share", "mode", "priority")


@dataclass(frozen=True)
class BoundCall:
    """One call's limit: which window to check, against which rates, for how many units."""

    scope: str
    key: str | None
    rates: tuple[Rate, ...]
    #: Units of every rate, or (rates of different units, costing differently) one count
    #: per rate: :func:`rate_costs`.
    cost: Cost
    algorithm: str
    #: The Redis key of the window state of this scope and key (:func:`.keys.state_key`).
    state_key: str
    #: The state's field name per rate, when not the rate's own: a live limit keeps the
    #: declared rate's window of the same length (see ``Checker.live``).
    fields: tuple[str, ...] | None = None
    #: At most this many bodies of this scope and key run at once (0: no such limit): the
    #: live K if one is set, else the declared one.
    concurrency: int = 0
    #: The cost of each unit, when declared by unit (``cost={"tokens": ...}``): what
    #: :attr:`cost` is made from again under other rates (a live limit).
    unit_costs: tuple[tuple[str, int], ...] = ()
    #: The K the code declares (0: none): what a slot falls back to when a live K is
    #: cleared (see :mod:`.slots`).
    declared_concurrency: int = 0
    #: The rates are a ceiling, each in force at the share of it the key's last pushback
    #: leaves (:mod:`.adapt`; window.lua scales them), or None.
    adapt: Adapt | None = None
    #: The key's part in its scope's share of :attr:`concurrency` slots (:mod:`.share`):
    #: (weight, most; 0: none), or None (the key's own K).
    share: tuple[float, int] | None = None
    #: In shadow mode: checked and reported, never held (the live mode, else the
    #: throttle's, else ``throttle_mode``: :meth:`.binding.Binder.bind_spec`).
    shadow: bool = False
    #: Its place in its key's line by the throttle's own ``priority=`` (higher first:
    #: :mod:`.priority`), or None (the message's priority says).
    priority: int | None = None

    @property
    def wait_reason(self) -> str:
        """What ``task_throttled`` says holds such a call when it waits: ``concurrency``
        for a throttle of slots alone, else ``rate``."""
        return "concurrency" if self.concurrency and not self.rates else "rate"


@dataclass(frozen=True)
class ThrottleSpec:
    """A declared throttle. Build with :meth:`declare` or :meth:`from_rule`."""

    rates: tuple[Rate, ...] | Callable[..., Any]
    key: str | Callable[..., Any] | None = None
    scope: str | None = None
    #: Units of every rate (an int or a callable), or by unit: ((unit, int or callable), ...).
    cost: int | Callable[..., Any] | tuple[tuple[str, int | Callable[..., Any]], ...] = 1
    algorithm: str | None = None
    #: Seconds a denied call may wait for its start at most (None: the setting's).
    max_wait: float | None = None
    #: Seconds added to each sliding window (None: the setting's), see ``throttle_margin``.
    margin: float | None = None
    #: At most this many bodies of a scope and key run at once, across every worker
    #: process (None: no such limit).
    concurrency: int | None = None
    #: A callable over the body's result returning what the call really cost (units):
    #: charged when the body returns (see :mod:`.settle`).
    cost_after: Callable[[Any], Any] | None = None
    #: The rates are a ceiling, the limit in force learns the downstream (:mod:`.adapt`).
    adapt: Adapt | None = None
    #: ``concurrency`` is the scope's, shared between its keys by weight (:mod:`.share`).
    share: Share | None = None
    #: "enforce" or "shadow" (None: ``throttle_mode``'s).
    mode: str | None = None
    #: Where a call joins its key's line, higher first (an int, or a callable over the
    #: task's arguments): in place of the message's priority; None: the message's.
    priority: int | Callable[..., Any] | None = None

    @classmethod
    def declare(
        cls,
        rates: Sequence[RateArg],
        key: str | Callable[..., Any] | None = None,
        scope: str | None = None,
        cost: CostArg = 1,
        algorithm: str | None = None,
        max_wait: float | None = None,
        margin: float | None = None,
        concurrency: int | None = None,
        cost_after: Callable[[Any], Any] | None = None,
        adapt: Any = None,
        share: Any = None,
        mode: str | None = None,
        priority: int | Callable[..., Any] | None = None,
    ) -> ThrottleSpec:
        adapted, shared = adapt_of(adapt), share_of(share)
        if mode is not None:
            check_mode(mode, "mode")
        if priority is not None and not callable(priority):
            check_urgency(priority, "priority")
        if shared is not None and (concurrency is None or key is None):
            raise ConfigurationError("share splits a scope's concurrency slots between its keys: give the throttle "
                                     "a concurrency and a key, e.g. throttle(concurrency=8, key='{tenant}', share=True)")
        if adapted is not None and not rates:
            raise ConfigurationError("adapt moves a rate's limit: give the throttle a rate")
        if cost_after is not None and not callable(cost_after):
            raise ConfigurationError(f"cost_after must be a callable over the task's result, got {cost_after!r}")
        if cost_after is not None and not rates:
            raise ConfigurationError("cost_after settles what a rate counted: give the throttle a rate")
        if concurrency is not None:
            check_positive(concurrency, "concurrency")
        if not rates and concurrency is None:
            raise ConfigurationError(
                'a throttle needs a rate, a concurrency, or both, e.g. throttle("10/s") or throttle(concurrency=4)'
            )
        if not rates:
            parsed: tuple[Rate, ...] | Callable[..., Any] = ()
        elif len(rates) == 1 and callable(rates[0]):
            parsed = rates[0]
        elif any(callable(r) for r in rates):
            raise ConfigurationError("a callable rate must be the only rate of a throttle")
        else:
            parsed = parse_rates(list(rates))
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ConfigurationError(f"unknown algorithm {algorithm!r}: use one of {ALGORITHMS}")
        if key is not None and not callable(key):
            if not isinstance(key, str) or not key:
                raise ConfigurationError(
                    f"key must be a format string such as '{{tenant_id}}' or a callable, got {key!r}"
                )
            template_fields(key)
        if scope is not None and (not isinstance(scope, str) or not scope):
            raise ConfigurationError(f"scope must be a non-empty string, got {scope!r}")
        declared = declared_cost(cost, parsed)
        if isinstance(parsed, tuple) and not callable(declared):
            # (A callable's units are known per call: the store refuses those that never fit.)
            fixed = declared if isinstance(declared, int) else rate_costs(
                parsed, [(unit, units if isinstance(units, int) else 0) for unit, units in declared])
            over = never_fits(parsed, fixed)
            if over is not None:
                raise ConfigurationError(f"cost {over[0]} can never fit in rate {over[1]}: a call would wait forever")
        check_max_wait(max_wait, "max_wait")
        check_margin(margin, "margin")
        return cls(parsed, key, scope, declared, algorithm, max_wait, margin, concurrency, cost_after, adapted,
                   shared, mode, priority)

    @classmethod
    def from_rule(cls, pattern: str, options: Mapping[str, Any]) -> ThrottleSpec:
        """A spec from one ``throttle_rules`` entry."""
        if not isinstance(options, Mapping) or not ("rate" in options or "concurrency" in options):
            raise ConfigurationError(
                f"throttle_rules[{pattern!r}] must be a dict with at least 'rate' or 'concurrency', got {options!r}"
            )
        unknown = set(options) - set(RULE_OPTIONS)
        if unknown:
            raise ConfigurationError(
                f"throttle_rules[{pattern!r}] has unknown option(s) {sorted(unknown)}; "
                f"known: {list(RULE_OPTIONS)}"
            )
        rate = options.get("rate", ())
        rates = list(rate) if isinstance(rate, (list, tuple)) else [rate]
        try:
            return cls.declare(
                rates,
                key=options.get("key"),
                scope=options.get("scope"),
                cost=options.get("cost", 1),
                algorithm=options.get("algorithm"),
                max_wait=options.get("max_wait"),
                margin=options.get("margin"),
                concurrency=options.get("concurrency"),
                cost_after=options.get("cost_after"),
                adapt=options.get("adapt"),
                share=options.get("share"),
                mode=options.get("mode"),
                priority=options.get("priority"),
            )
        except ConfigurationError as exc:
            raise ConfigurationError(f"throttle_rules[{pattern!r}]: {exc}") from None

    @property
    def _callables(self) -> bool:
        """Whether anything of a call is a callable over its arguments."""
        costs = self.cost if isinstance(self.cost, tuple) else ((None, self.cost),)
        return (callable(self.rates) or callable(self.key) or any(callable(c) for _, c in costs)
                or (self.share is not None and callable(self.share.weight)) or callable(self.priority))

    def check_signature(self, fn: Callable[..., Any], where: str) -> None:
        """Fail now if the key template names an argument ``fn`` does not take, or a share's
        weight callable cannot take ``fn``'s arguments (by name, as a key binds them, or
        as they are passed)."""
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return
        if self.share is not None and callable(self.share.weight):
            _check_takes(self.share.weight, params, where)
        if callable(self.priority):
            _check_takes(self.priority, params, where, "the priority callable", "priority")
        if not isinstance(self.key, str):
            return
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        missing = [name for name in template_fields(self.key) if name not in params]
        if missing:
            raise ConfigurationError(
                f"{where}: key {self.key!r} names {', '.join(map(repr, missing))}, "
                f"but the task takes ({', '.join(params)})"
            )

    def bind(
        self,
        task_name: str,
        signature: inspect.Signature | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        default_algorithm: str,
        prefix: str,
    ) -> BoundCall:
        """Resolve scope, key, rates and cost for one call of ``task_name``, whose window
        state is kept under ``prefix``."""
        scope = self.scope or task_name
        algorithm = self.algorithm or default_algorithm
        named = named_arguments(signature, args, kwargs) if self._callables else None
        if isinstance(self.rates, tuple):
            rates = self.rates
        else:
            value = _call(self.rates, task_name, "rate", args, kwargs, named)
            try:
                rates = parse_rates(value)
            except ConfigurationError as exc:
                raise KeyBuildError(f"task {task_name}: the rate callable returned {value!r}: {exc}") from None
        unit_costs: tuple[tuple[str, int], ...] = ()
        if isinstance(self.cost, tuple):
            unit_costs = tuple((unit, self._units(task_name, c, args, kwargs, f"cost of {unit!r}", named))
                               for unit, c in self.cost)
            cost = rate_costs(rates, unit_costs)
        else:
            cost = self._units(task_name, self.cost, args, kwargs, "cost", named)
        key = self._key(task_name, signature, args, kwargs, named)
        share = None
        if self.share is not None:
            share = (self._weight(task_name, self.share.weight, args, kwargs, named), self.share.most or 0)
        priority = self.priority
        if callable(priority):
            value = _call(priority, task_name, "priority", args, kwargs, named)
            try:
                priority = check_urgency(value, "the priority callable's answer")
            except ConfigurationError as exc:
                raise KeyBuildError(f"task {task_name}: {exc}") from None
        return BoundCall(scope, key, rates, cost, algorithm, state_key(prefix, scope, key),
                         concurrency=self.concurrency or 0, unit_costs=unit_costs,
                         declared_concurrency=self.concurrency or 0, share=share, priority=priority)

    @staticmethod
    def _weight(task_name: str, weight: float | Callable[..., Any], args: Sequence[Any],
                kwargs: Mapping[str, Any], named: Mapping[str, Any] | None = None) -> float:
        """A key's weight in its scope's share: the number, or what its callable answers."""
        if not callable(weight):
            return float(weight)
        value = _call(weight, task_name, "share weight", args, kwargs, named)
        try:
            return check_weight(value)
        except ConfigurationError as exc:
            raise KeyBuildError(f"task {task_name}: {exc}") from None

    @staticmethod
    def _units(task_name: str, cost: int | Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
               what: str, named: Mapping[str, Any] | None = None) -> int:
        """A declared cost of one call: the int, or what its callable answers (checked)."""
        if not callable(cost):
            return cost
        value = _call(cost, task_name, what, args, kwargs, named)
        try:
            check_positive(value, what)
        except ConfigurationError as exc:
            raise KeyBuildError(f"task {task_name}: {exc}") from None
        return int(value)

    def _key(
        self,
        task_name: str,
        signature: inspect.Signature | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        named: Mapping[str, Any] | None = None,
    ) -> str | None:
        if self.key is None:
            return None
        if callable(self.key):
            value = _call(self.key, task_name, "key", args, kwargs, named)
            if value is None or value == "" or not isinstance(value, (str, int)):
                raise KeyBuildError(
                    f"task {task_name}: the key callable returned {value!r}; it must return a non-empty string"
                )
            return str(value)
        return format_key(self.key, task_name, signature, args, kwargs)


def _call(fn: Callable[..., Any], task_name: str, what: str, args: Sequence[Any], kwargs: Mapping[str, Any],
          named: Mapping[str, Any] | None = None) -> Any:
    """``fn`` over one call's arguments: by name (``named``: bound to the task's signature,
    so a positional call and a keyword one look alike, as keys see them) where ``fn``
    takes them so, else as the call passed them."""
    try:
        if named is not None and _binds(fn, named):
            return fn(**named)
        return fn(*args, **kwargs)
    except Exception as exc:
        raise KeyBuildError(f"task {task_name}: the {what} callable raised {exc!r}") from exc


def _check_takes(weight: Callable[..., Any], params: Mapping[str, inspect.Parameter], where: str,
                 what: str = "the share's weight callable", spelt: str = "weight") -> None:
    """ConfigurationError unless ``weight`` (``what``: the share's weight, a priority)
    takes a task's arguments (``params``; a bound task's ``self`` aside) by name or as passed."""
    signature = _signature_of(weight)
    if signature is None or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        return
    names = [name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    if names[:1] == ["self"]:
        names = names[1:]
    for args, kwargs in (((), dict.fromkeys(names)), ((None,) * len(names), {})):
        try:
            signature.bind(*args, **kwargs)
            return
        except TypeError:
            continue
    raise ConfigurationError(f"{where}: {what} takes {signature}, but the task takes "
                             f"({', '.join(names)}): take them by name, e.g. {spelt}=lambda {names[0] if names else 'x'}, "
                             f"**_: ...")


@lru_cache(maxsize=1024)
def _signature_of(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _binds(fn: Callable[..., Any], named: Mapping[str, Any]) -> bool:
    signature = _signature_of(fn)
    if signature is None:
        return False
    try:
        signature.bind(**named)
    except TypeError:
        return False
    return True


def named_arguments(signature: inspect.Signature | None, args: Sequence[Any],
                    kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """One call's arguments by name, bound to the task's ``signature`` with its defaults
    (None: they cannot be named: no signature and positional arguments, or they do not fit)."""
    if signature is None:
        return None if args else dict(kwargs)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
    return named


def declared_spec(task: Any) -> ThrottleSpec | None:
    """The spec of a ``@throttle`` on a task, above (on its class) or below (on its function)."""
    spec = type(task).__dict__.get("_throttle_spec")
    if spec is None:
        spec = getattr(getattr(task, "run", None), "__throttle__", None)
    return spec if isinstance(spec, ThrottleSpec) else None


def direct_call(prefix: str, default_algorithm: str, scope: Any, key: Any, rates: Any, cost: Any,
                algorithm: str | None) -> BoundCall:
    """A call of :meth:`.Throttle.acquire` (and of the operators' calls, to check a scope
    and key), bound: its scope, key, rates, cost and algorithm checked."""
    if not isinstance(scope, str) or not scope:
        raise ConfigurationError(f"scope must be a non-empty string, got {scope!r}")
    if key is not None and not isinstance(key, str):
        raise ConfigurationError(f"key must be a string or None, got {key!r}")
    algorithm = algorithm or default_algorithm
    if algorithm not in ALGORITHMS:
        raise ConfigurationError(f"unknown algorithm {algorithm!r}: use one of {ALGORITHMS}")
    parsed = parse_rates(rates)
    checked = direct_cost(cost, parsed)
    if isinstance(checked, int):
        return BoundCall(scope, key, parsed, checked, algorithm, state_key(prefix, scope, key))
    return BoundCall(scope, key, parsed, rate_costs(parsed, checked), algorithm, state_key(prefix, scope, key),
                     unit_costs=checked)
