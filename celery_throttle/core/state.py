"""What the store holds, as data: the window state hash's format and layout and the names
of its fields, and the control hash's constants (controls read it; store/controls.py and
pause.lua write it). CHANGELOG.md records each change of a format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .rates import Rate

__all__ = ["ALGORITHM_TAGS", "CONTROL_STAMP", "FOREVER_US", "STATE_FORMAT", "STATE_LAYOUT", "StateLayout",
           "rate_field", "rate_of_field"]

#: The layout of a window state hash (window.lua's field 'f'; absent: written before the
#: field, format 1). A hash of another format (a later version's, and the deploy rolled
#: back) is started afresh, as if it had expired: what it counted is forgotten (at most
#: one window's starts counted twice over). CHANGELOG.md records each format.
STATE_FORMAT = 1


@dataclass(frozen=True)
class StateLayout:
    """How a rate's state is laid out in its field of the hash: part of the state's format
    (sliding.lua and fixed.lua are loaded with it, and the reference model built with it;
    the tests load both with another, tests/script/test_model_check.py)."""

    #: Buckets per window of a sliding rate: a bucket spans 1/BUCKETS of it (at least 1 ms).
    buckets: int = 100
    #: Buckets a sliding rate keeps at most; past it the front is folded even if it could
    #: still decide something (safe, a little late: only a sparse schedule, of a rate that
    #: another rate holds back, reaches it; a saturated one spans about BUCKETS buckets).
    max_buckets: int = 200
    #: Windows after the current one a fixed rate keeps before folding the older ones...
    max_ahead: int = 8
    #: ... and how many of the last of them stay as they are.
    keep_ahead: int = 4

    def values(self) -> dict[str, int]:
        """The constants the algorithm scripts read, by their names there."""
        return {"BUCKETS": self.buckets, "MAX_BUCKETS": self.max_buckets, "MAX_AHEAD": self.max_ahead,
                "KEEP_AHEAD": self.keep_ahead}


STATE_LAYOUT = StateLayout()

# -- the control hash ----------------------------------------------------------------

#: The end of a pause with no end: the largest integer a Lua number holds exactly.
FOREVER_US = 2**53 - 1
#: The field every write of the control hash adds one to (not a control: ignored by each
#: version's reader).
CONTROL_STAMP = "~stamp"


#: The first letter of a rate's field in the state hash: "s25/1000000" holds sliding
#: "25/s". ``Throttle.status`` reads the rates a hash holds back from these names.
ALGORITHM_TAGS = {"sliding": "s", "fixed": "f"}


def rate_field(algorithm: str, rate: Rate) -> str:
    """The state hash's field of ``rate``: "s25/1000000" holds sliding "25/s", and
    "s30000/60000000.tokens" sliding "30000 tokens/m"."""
    unit = f".{rate.unit}" if rate.unit else ""
    return f"{ALGORITHM_TAGS[algorithm]}{rate.limit}/{rate.period_us}{unit}"


def rate_of_field(field: str) -> tuple[str, int, int, str] | None:
    """(algorithm, limit, period in µs, unit) of a field :func:`rate_field` named, or None
    for any other field (one written by hand included: a limit or a window of 0, digits
    other than ASCII, a unit no rate can name)."""
    named = _RATE_FIELD.match(field)
    if named is None:
        return None
    tag, limit, period_us, unit = named.groups()
    return _ALGORITHM_OF_TAG[tag], int(limit), int(period_us), unit or ""


#: A rate's field as :func:`rate_field` writes it (a unit as ``rates.UNIT_NAME`` has it).
_RATE_FIELD = re.compile(f"([{''.join(ALGORITHM_TAGS.values())}])" r"([1-9][0-9]*)/([1-9][0-9]*)(?:\.([a-z_][a-z0-9_]*))?\Z")


_ALGORITHM_OF_TAG = {tag: algorithm for algorithm, tag in ALGORITHM_TAGS.items()}
