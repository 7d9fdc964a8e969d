"""An option of ``@throttle`` declared as ``True`` (its defaults), an instance of its class,
a dict of its fields (a rule's), or ``None``/``False`` (off): ``adapt=`` and ``share=``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from .errors import ConfigurationError

__all__ = ["option_of"]

T = TypeVar("T")


def option_of(value: Any, kind: type[T], name: str) -> T | None:
    """``value`` as the option ``name`` of class ``kind`` (a dataclass whose fields all have
    defaults), or None when it is off; anything else is a ConfigurationError naming it."""
    if value is None or value is False:
        return None
    if value is True:
        return kind()
    if isinstance(value, kind):
        return value
    known = [f.name for f in fields(kind)]  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        unknown = set(value) - set(known)
        if unknown:
            raise ConfigurationError(f"{name} has unknown option(s) {sorted(unknown)}; known: {', '.join(known)}")
        return kind(**value)
    article = "an" if kind.__name__[0] in "AEIOU" else "a"
    raise ConfigurationError(f"{name} must be True, {article} {kind.__name__}(...) or a dict of {'/'.join(known)}, "
                             f"got {value!r}")
