"""The control hash's fields and what they hold (see :mod:`.controls`): their names, and
the controls set as one value: pauses, live limits and K."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from ..core.config import check_mode
from ..core.errors import ConfigurationError
from ..core.keys import decode, encode
from ..core.rates import Rate, parse_rates

__all__ = ["APP_MODE", "REPLACE_ALL", "ControlSet", "control_target", "limit_field", "merged_rates", "mode_field",
           "parse_controls", "pause_field", "replace_field", "slots_field"]

logger = logging.getLogger("celery_throttle")

#: The value of a ``replace:`` field (not all digits: pause.lua prunes those as pauses over).
REPLACE_ALL = "all"
#: The field of the whole app's live mode (an encoded scope is never ``*``).
APP_MODE = "mode:*"


def _field(kind: str, scope: str, key: str | None) -> str:
    return f"{kind}:{encode(scope)}" if key is None else f"{kind}:{encode(scope)}:{encode(key)}"


def control_target(field: str) -> tuple[str, str | None] | None:
    """(scope, key) a control field names, or None for a field we do not write."""
    kind, _, rest = field.partition(":")
    if kind not in ("pause", "limit", "slots", "mode") or not rest or field == APP_MODE:
        return None
    scope, sep, key = rest.partition(":")
    return decode(scope), (decode(key) if sep else None)


def pause_field(scope: str, key: str | None) -> str:
    return _field("pause", scope, key)


def limit_field(scope: str, key: str | None) -> str:
    return _field("limit", scope, key)


def slots_field(scope: str, key: str | None) -> str:
    return _field("slots", scope, key)


def mode_field(scope: str | None, key: str | None) -> str:
    """The field of the live mode of ``scope``/``key`` (scope None: the whole app's)."""
    return APP_MODE if scope is None else _field("mode", scope, key)


def replace_field(scope: str, key: str | None) -> str:
    """The field that makes the live limit of ``scope``/``key`` replace every declared rate."""
    return _field("replace", scope, key)


def merged_rates(declared: tuple[Rate, ...], live: tuple[Rate, ...], replace_all: bool = False) -> tuple[Rate, ...]:
    """The rates in force under a live limit: ``live``, and each ``declared`` rate of a
    window length and unit that ``live`` does not set (none with ``replace_all``). A live
    ``2/s`` on ``10/s, 5000/h`` gives ``2/s, 5000/h``: lowering one rate in an incident
    must not lift a quota of another window."""
    if replace_all:
        return live
    windows = {(r.period_us, r.unit) for r in live}
    return tuple(sorted({*live, *(r for r in declared if (r.period_us, r.unit) not in windows)}))


class ControlSet(NamedTuple):
    """The controls set: pauses (field to end, µs), live limits (field to rates), live
    concurrency limits (field to K), and the live limits that replace every declared rate
    (their ``limit:`` fields)."""

    pauses: dict[str, int]
    limits: dict[str, tuple[Rate, ...]]
    slots: dict[str, int]
    replacing: frozenset[str] = frozenset()
    #: Live modes: field (:func:`mode_field`) to "enforce" or "shadow".
    modes: Mapping[str, str] = MappingProxyType({})

    def fields(self) -> list[str]:
        return [*self.pauses, *self.limits, *self.slots, *self.modes]

    def mode_of(self, scope: str, key: str | None) -> str | None:
        """The live mode of ``scope``/``key``: the key's own, else its scope's, else the
        app's; None if none is set."""
        modes = self.modes
        if not modes:
            return None
        return ((key is not None and modes.get(mode_field(scope, key))) or modes.get(mode_field(scope, None))
                or modes.get(APP_MODE))

    def paused_until(self, scope: str, key: str | None) -> int:
        """The end of the pause (µs, Redis clock) covering ``scope``/``key``, or 0."""
        pauses = self.pauses
        if not pauses:
            return 0
        until = pauses.get(pause_field(scope, None), 0)
        return max(until, pauses.get(pause_field(scope, key), 0)) if key is not None else until

    def limit_of(self, scope: str, key: str | None) -> tuple[Rate, ...] | None:
        """The live limit of ``scope``/``key`` (the key's own first), or None."""
        limits = self.limits
        if not limits:
            return None
        return (key is not None and limits.get(limit_field(scope, key))) or limits.get(limit_field(scope, None))

    def replaces_all(self, scope: str, key: str | None) -> bool:
        """Whether the live limit :meth:`limit_of` finds replaces every declared rate."""
        limits = self.limits
        if not limits:
            return False
        own = limit_field(scope, key) if key is not None else None
        field = own if own is not None and own in limits else limit_field(scope, None)
        return field in self.replacing

    def rates_of(self, scope: str, key: str | None, declared: tuple[Rate, ...]) -> tuple[Rate, ...]:
        """The rates in force for a call of ``scope``/``key`` that declares ``declared``:
        :func:`merged_rates` under its live limit, if one is set, else ``declared``."""
        live = self.limit_of(scope, key)
        if live is None:
            return declared
        return merged_rates(declared, live, self.replaces_all(scope, key))

    def concurrency_of(self, scope: str, key: str | None) -> int | None:
        """The live concurrency limit of ``scope``/``key`` (the key's own first), or None."""
        slots = self.slots
        if not slots:
            return None
        return (key is not None and slots.get(slots_field(scope, key))) or slots.get(slots_field(scope, None))


def parse_controls(raw: Mapping[str, str]) -> ControlSet:
    """(pauses, live limits, live concurrency limits) from the control hash; a value that
    does not read is skipped (with a log line), never fatal: the hash is written by hand
    too, through redis-cli."""
    controls = ControlSet({}, {}, {})
    replacing: set[str] = set()
    modes: dict[str, str] = {}
    for field, value in raw.items():
        try:
            if field.startswith("pause:"):
                controls.pauses[field] = int(value)
            elif field.startswith("limit:"):
                controls.limits[field] = parse_rates(value.split(","))
            elif field.startswith("slots:"):
                concurrency = int(value)
                if concurrency < 1:
                    raise ValueError(f"a concurrency limit is at least 1, got {concurrency}")
                controls.slots[field] = concurrency
            elif field.startswith("mode:"):
                check_mode(value, "a mode")
                modes[field] = value
            elif field.startswith("replace:"):
                replacing.add("limit:" + field.removeprefix("replace:"))
        except (ValueError, ConfigurationError) as exc:
            if (field, value) not in _warned:
                _warned.add((field, value))
                logger.warning("celery_throttle: ignoring control %s=%r: %s", field, value, exc)
    if replacing:
        controls = controls._replace(replacing=frozenset(replacing))
    return controls._replace(modes=modes) if modes else controls


_warned: set[tuple[str, str]] = set()  # (each bad control is logged once per process)
