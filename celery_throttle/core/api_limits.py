"""What an API says of its own window, read from a reply's headers (pure).

Many APIs send their count on every reply: how many requests (and tokens) are left in the
window they enforce. A client that reads only its own count cannot see the calls the API
counted that it did not (another client on the same account, a retry it never saw, a
call that cost more tokens than its estimate); one that reads the API's can. The header
families read, each name case-insensitive:

- ``x-ratelimit-remaining-requests`` / ``-tokens`` (OpenAI and its imitators);
- ``anthropic-ratelimit-requests-remaining``, ``-tokens-``, ``-input-tokens-``,
  ``-output-tokens-remaining`` (Anthropic);
- ``x-ratelimit-remaining`` (GitHub, Discord and many more), ``x-rate-limit-remaining``
  (X), ``ratelimit-remaining`` (the IETF draft's first fields): requests;
- ``RateLimit`` as the IETF draft writes it now (``"default";r=50;t=30``: the remaining
  quota ``r`` of each policy) or as its earlier versions did (``limit=100, remaining=50,
  reset=30``): requests.

:func:`remaining` answers the least each unit has left, by the unit names rates use
(``""`` for requests: a rate of calls; ``tokens``, ``input_tokens``, ``output_tokens``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["remaining"]

#: Header -> the unit its number counts ("" : requests, as a rate of calls counts them).
_FIELDS = {
    "x-ratelimit-remaining-requests": "",
    "x-ratelimit-remaining-tokens": "tokens",
    "anthropic-ratelimit-requests-remaining": "",
    "anthropic-ratelimit-tokens-remaining": "tokens",
    "anthropic-ratelimit-input-tokens-remaining": "input_tokens",
    "anthropic-ratelimit-output-tokens-remaining": "output_tokens",
    "x-ratelimit-remaining": "",
    "x-rate-limit-remaining": "",
    "ratelimit-remaining": "",
}
#: The longest header value read (a reply's headers are the API's, or a proxy's: bounded).
_MOST_CHARS = 1000
_INT = re.compile(r"\s*(\d{1,18})(?:\.\d*)?\s*$")
#: ``r=50`` in the IETF draft's RateLimit field, ``remaining=50`` in its earlier versions.
_REMAINING = re.compile(r"(?:^|[;,\s])(?:r|remaining)\s*=\s*(\d{1,18})(?!\d)")


def remaining(headers: Any) -> dict[str, int]:
    """The least each unit has left in the API's window, as ``headers`` (a mapping, or
    anything with ``items()``) say; units they say nothing of are absent. Values that do
    not read as whole numbers are ignored, never guessed."""
    items = headers.items() if isinstance(headers, Mapping) or hasattr(headers, "items") else ()
    found: dict[str, int] = {}

    def note(unit: str, value: int) -> None:
        found[unit] = min(value, found.get(unit, value))

    for name, value in items:
        if not isinstance(name, (str, bytes)) or not isinstance(value, (str, bytes, int)):
            continue
        name = (name.decode("latin-1") if isinstance(name, bytes) else name).strip().lower()
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        text = text[:_MOST_CHARS]
        unit = _FIELDS.get(name)
        if unit is not None:
            matched = _INT.match(text)
            if matched:
                note(unit, int(matched.group(1)))
        elif name == "ratelimit":
            for matched in _REMAINING.finditer(text):
                note("", int(matched.group(1)))
    return found
