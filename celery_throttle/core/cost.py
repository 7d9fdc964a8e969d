"""What a call costs, checked in one place: a declared cost (an int, a callable over the
task's arguments, or a cost by unit), the cost a direct ``acquire`` is given, and what a
cost by unit counts in each rate.

Whether a cost can ever fit its rates is one rule, :func:`never_fits`. The window script
applies it to every call, under the rates its caller gives it (a callable cost; a live
limit lowered since, which each process reads within CONTROL_REFRESH), and to the tasks of
a line it releases (line.lua answers or reports ``TOO_COSTLY``); :func:`too_costly` says
which rate. A declaration's fixed cost is held to it at once, so that a throttle that
could never run fails at import."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from .errors import ConfigurationError, ThrottleError
from .protocol import Cost, one_cost, per_rate
from .rates import UNIT_NAME, Rate
from .timing import as_declared

__all__ = ["CostArg", "check_positive", "declared_cost", "direct_cost", "never_fits", "rate_costs", "too_costly"]

#: A declared cost: units of every rate (an int, or a callable over the task's arguments),
#: or a cost per unit its rates name, ``{"tokens": estimate}`` (any other unit: 1).
CostArg = int | Callable[..., Any] | Mapping[str, int | Callable[..., Any]]


def rate_costs(rates: Sequence[Rate], unit_costs: Sequence[tuple[str, int]]) -> Cost:
    """What a call costing ``unit_costs`` (by unit; a unit not named: 1) counts in each of
    ``rates``: one int when that is the same for every rate, else a count per rate."""
    table = dict(unit_costs)
    return one_cost([table.get(r.unit, 1) for r in rates]) if rates else 1


def declared_cost(cost: Any, rates: tuple[Rate, ...] | Callable[..., Any]
                   ) -> int | Callable[..., Any] | tuple[tuple[str, int | Callable[..., Any]], ...]:
    """``cost`` as a spec keeps it, checked: an int, a callable, or by unit."""
    if callable(cost):
        return cost  # (a class too: what it answers is checked per call)
    if not isinstance(cost, Mapping):
        check_positive(cost, "cost")
        return int(cost)
    if not cost:
        raise ConfigurationError('cost by unit names at least one unit, e.g. cost={"tokens": 500}')
    by_unit = []
    for unit, units in cost.items():
        if not isinstance(unit, str) or not UNIT_NAME.match(unit):
            raise ConfigurationError(f"cost names units by their rates' names, such as 'tokens' in "
                                     f"\"30000 tokens/m\"; got {unit!r}")
        if not callable(units):
            check_positive(units, f"cost of {unit!r}")
        by_unit.append((unit, units))
    if isinstance(rates, tuple):
        counted = {r.unit for r in rates}
        unknown = [unit for unit, _ in by_unit if unit not in counted]
        if unknown:
            raise ConfigurationError(
                f"cost names unit(s) {unknown} that no rate counts; rates: {[str(r) for r in rates]} "
                '(a rate counts a unit when it names it: "30000 tokens/m")'
            )
    return tuple(sorted(by_unit, key=lambda pair: pair[0]))


def check_positive(value: Any, what: str) -> None:
    """``value`` (a cost, a concurrency) is a positive integer, else a ConfigurationError
    naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{what} must be a positive integer, got {value!r}")


def direct_cost(cost: Any, rates: tuple[Rate, ...]) -> int | tuple[tuple[str, int], ...]:
    """The cost given to a direct ``acquire``, checked as a declared one is: an int, or a
    cost by unit of the ``rates`` (no callable: there are no task arguments to call it on)."""
    if callable(cost) or (isinstance(cost, Mapping) and any(callable(v) for v in cost.values())):
        raise ConfigurationError(f"acquire takes a cost of units (an int, or by unit), not a callable: {cost!r}")
    return cast("int | tuple[tuple[str, int], ...]", declared_cost(cost, rates))


def never_fits(rates: Sequence[Rate], cost: Cost) -> tuple[int, Rate] | None:
    """(units, rate): the first of ``rates`` whose limit ``cost`` is above (a call of it
    can never start), or None."""
    for rate, units in zip(rates, per_rate(cost, len(rates))):
        if units > rate.limit:
            return units, rate
    return None


def too_costly(scope: str, rates: Sequence[Rate], cost: Cost) -> ThrottleError:
    """The error of a call of ``scope`` that the store refused as costing more than a
    rate's limit (``rates`` and ``cost``: as this process bound the call; when none of
    them is exceeded, the script refused the units a released task was counted at when
    it joined its line)."""
    over = never_fits(rates, cost)
    if over is None:
        return ThrottleError(f"cost {cost} of scope {scope!r} exceeds the limit of a rate in force: it can never run")
    units, rate = over
    return ThrottleError(f"cost {units} of scope {scope!r} exceeds the limit of its rate {as_declared(rate)}: "
                         "it can never run")
